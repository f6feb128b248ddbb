"""The README's first example runs as written, on 2 gloo ranks (so it cannot rot)."""
import os
import re
import subprocess
import sys

import pytest

from tools.teardown_loop import first_example  # one home: the loop runs it too

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_first_example_is_complete_python():
    code = first_example()
    compile(code, "first_example.py", "exec")
    for name in ("import torch", "SparseAllreduce", "init_process_group", "reduce_gradients"):
        assert name in code


@pytest.mark.slow
def test_first_example_runs_on_two_gloo_ranks(tmp_path):
    path = tmp_path / "first_example.py"
    path.write_text(first_example())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", str(path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 3, out[-3000:]
    assert losses[-1] < losses[0], losses                  # it trains
    assert "sent" in proc.stdout and "Traceback" not in out, out[-3000:]
    # the example ends with oktopk_triton.shutdown(exit_code=0): no gloo teardown abort
    assert proc.returncode == 0, out[-3000:]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_in_the_docs_resolves():
    """README.md, docs/*.md, docs/research/*.md and tools/research/README.md: each relative link
    names a file of the repository (relative to the file holding it), and each #anchor a heading
    of its target."""
    docs = ["README.md", os.path.join("tools", "research", "README.md")] + [
        os.path.join(d, f) for d in ("docs", os.path.join("docs", "research"))
        for f in sorted(os.listdir(os.path.join(ROOT, d))) if f.endswith(".md")]
    broken = []
    for doc in docs:
        text = open(os.path.join(ROOT, doc)).read()
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), target or
                                                 os.path.basename(doc)))
            if not os.path.exists(path):
                broken.append(f"{doc}: {target}")
            elif anchor and path.endswith(".md"):
                heads = {_anchor(h) for h in re.findall(r"^#+ (.+)$", open(path).read(), re.M)}
                if anchor not in heads:
                    broken.append(f"{doc}: {target}#{anchor}")
    assert not broken, broken


def _readme() -> str:
    return open(os.path.join(ROOT, "README.md")).read()


def test_readme_is_a_guide_in_order():
    """At most 340 lines; its sections in the order a newcomer reads them; the rest in docs/."""
    text = _readme()
    assert len(text.splitlines()) <= 340, len(text.splitlines())
    heads = re.findall(r"^## (.+)$", text, re.M)
    assert heads == ["Install", "The two commands", "Presets", "A first example",
                     "Ways to use it", "Surviving failures", "Options", "Results",
                     "Known gaps"], heads
    presets = text[text.index("## Presets"):text.index("## A first example")]
    from oktopk_triton.presets import PRESETS
    assert all(f"| `{name}` |" in presets for name in PRESETS)      # the table names each one
    advice = [line for line in presets.splitlines() if line.startswith("**Transformers")]
    assert len(advice) == 1 and "recommend(" in advice[0]            # the advice: one line
    survive = text[text.index("## Surviving failures"):text.index("## Options")]
    assert len(survive.splitlines()) <= 25
    results = text[text.index("## Results"):text.index("## Known gaps")]
    for question in ("**How fast is a step?**", "**How good is the model?**",
                     "**Which algorithm?**"):
        assert question in results
        assert "\n| " in results[results.index(question):]        # each answered by a table
    assert "recommended configuration" not in text and "moment_realign" not in text


def _strip(line: str) -> str:
    return line.strip().split("  #")[0].strip()


def snippets_of(text: str):
    """``(example path, lines of the snippet not in that example)`` for every ``<!-- snippet:
    examples/... -->`` block of ``text`` (one home: the docs' snippets are checked with it)."""
    found = []
    for path, code in re.findall(r"<!-- snippet: (examples/\S+) -->\s*```python\n(.*?)```",
                                 text, re.S):
        lines = {_strip(x) for x in open(os.path.join(ROOT, path)).read().splitlines()}
        found.append((path, [x for x in map(_strip, code.splitlines()) if x and x not in lines]))
    return found


def test_readme_framework_snippets_are_lines_of_the_tested_examples():
    """Each framework snippet is made of lines of its example (run twice, first run included, by
    tests/test_examples.py), so a snippet runs on a first run as written."""
    snippets = snippets_of(_readme())
    assert {path for path, _ in snippets} == {
        "examples/lightning_sparse.py", "examples/accelerate_sparse.py",
        "examples/trainer_sparse.py", "examples/fsdp_hsdp_sparse.py", "examples/torchft_diloco.py"}
    for path, missing in snippets:
        assert not missing, (path, missing)
    text = _readme()
    assert 'ckpt_path="last.ckpt"' not in text and "resume_from_checkpoint=True" not in text


def test_readme_results_figures_are_in_the_docs():
    """Every decimal figure of the README's results is also in docs/research/ (results.md,
    gpu-measurements.md, techniques.md), where each is traced to its result file."""
    text = _readme()
    results = text[text.index("## Results"):text.index("## Known gaps")]
    docs = "".join(open(os.path.join(ROOT, "docs", "research", f)).read()
                   for f in ("results.md", "gpu-measurements.md", "techniques.md"))
    figures = set(re.findall(r"(?<![\w.^])\d+\.\d+(?![\w.])", results))
    assert len(figures) > 30
    assert not sorted(f for f in figures if f not in docs)


def test_readme_result_files_exist():
    """Every result file (or folder, or pattern) the README names under bench/results/ is there."""
    import glob
    paths = re.findall(r"`(bench/results/[^`]+)`", _readme())
    assert len(paths) >= 5
    for path in paths:
        if "..." in path:
            continue
        pattern = re.sub(r"\{([^}]*)\}", lambda m: "[" + m.group(1).replace(",", "") + "]", path)
        assert glob.glob(os.path.join(ROOT, pattern)), path
