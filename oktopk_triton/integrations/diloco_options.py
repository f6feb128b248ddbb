"""SparseDiLoCo's options: torchft DiLoCo's, checked as torchft checks them, and the sparse
reduce's (a DiLoCo preset, or a density and an algorithm; the residual decay; should_quantize
as the 2-bit wire), each refused in one line when it does not fit."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Tuple, Union

import torch

from ..config import AlgorithmConfig, as_config
from ..presets import diloco_preset

__all__ = ["check_diloco_options", "diloco_config"]

log = logging.getLogger("oktopk_triton.integrations.torchft")


def check_diloco_options(model_fragments: Any, sync_every: Any, fragment_sync_delay: Any,
                          fragment_update_alpha: Any) -> None:
    """torchft DiLoCo's options, checked as torchft checks them, each with a one-line error."""
    if not isinstance(model_fragments, (list, tuple)) or not model_fragments or not all(
            isinstance(m, torch.nn.Module) for m in model_fragments):
        raise ValueError("SparseDiLoCo: model_fragments must be a non-empty list of nn.Module")
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"SparseDiLoCo: sync_every must be a positive int, got {sync_every!r}")
    F = len(model_fragments)
    if sync_every % F:
        raise ValueError(f"SparseDiLoCo: sync_every must be a multiple of the number of "
                         f"fragments ({F}), got {sync_every}")
    if isinstance(fragment_sync_delay, bool) or not isinstance(fragment_sync_delay, int) or \
            not 0 <= fragment_sync_delay < sync_every // F:
        raise ValueError(f"SparseDiLoCo: fragment_sync_delay must be an int in [0, "
                         f"{sync_every // F}) (sync_every / fragments), got "
                         f"{fragment_sync_delay!r}")
    if isinstance(fragment_update_alpha, bool) or \
            not isinstance(fragment_update_alpha, (int, float)) or \
            not 0.0 <= fragment_update_alpha <= 1.0:
        raise ValueError(f"SparseDiLoCo: fragment_update_alpha must be a number in [0, 1], got "
                         f"{fragment_update_alpha!r}")
    seen: set = set()
    for m in model_fragments:
        ids = {id(q) for q in m.parameters()}
        if ids & seen:
            raise ValueError("SparseDiLoCo: the model fragments share parameters; each "
                             "parameter must belong to one fragment")
        seen |= ids


def diloco_config(numel: int, density: Optional[float],
                   algorithm: Union[str, AlgorithmConfig, None], preset: Any,
                   residual_decay: Optional[float], should_quantize: bool
                   ) -> Tuple[float, AlgorithmConfig, float]:
    """(density, algorithm object, residual decay) of a SparseDiLoCo: from a DiLoCo preset
    (``preset``, or ``"diloco"`` when none of density, algorithm and preset is given) or from
    the arguments; ``should_quantize`` maps to the 2-bit wire. Logged in one line each."""
    if preset is None and density is None and algorithm is None:
        preset = "diloco"
    if preset is not None:
        density, config, decay = diloco_preset(preset, numel, density=density,
                                               algorithm=algorithm,
                                               residual_decay=residual_decay)
    else:
        density = 0.05 if density is None else density
        config = as_config("oktopk" if algorithm is None else algorithm)
        decay = 1.0 if residual_decay is None else residual_decay
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay <= 1.0:
        raise ValueError(f"SparseDiLoCo: residual_decay must be a number in (0, 1], got "
                         f"{decay!r}")
    if should_quantize:
        config = _quantized(config)
    return density, config, float(decay)


def _quantized(config: AlgorithmConfig) -> AlgorithmConfig:
    """torchft's ``should_quantize`` as the sparse wire's counterpart: ``wire_format="q2"``
    (2-bit values); a packed wire already chosen is kept; an algorithm without q2 is refused."""
    from ..algorithms._wire import packed
    if packed(config.wire_format):
        return config
    try:
        quantized = dataclasses.replace(config, wire_format="q2")
    except ValueError as exc:
        raise ValueError(f"SparseDiLoCo: should_quantize=True maps to wire_format='q2', which "
                         f"{config.algorithm} cannot send ({' '.join(str(exc).split())})") from None
    log.info("SparseDiLoCo: should_quantize=True sends the pseudo-gradient on the 2-bit wire "
             "(wire_format='q2', its quantization error kept in the residual)")
    return quantized
