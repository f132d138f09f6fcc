"""An emulated device, for benchmarks only: the real CPU path, the forward replaced by a wait.

`SHOAL_EMULATE_DEVICE=<profile>` (a name of `runtimes.doubles.profiles.PROFILES`, e.g.
`h100/minilm`, or explicit `fixed_ms,per_token_us`, e.g. `0.25,0.2`) in a runtime
process's environment (a worker's runtime inherits the worker's:
`SHOAL_EMULATE_DEVICE=h100/minilm shoal worker`) installs this module as the PyTorch
engine's device seam (`EmulatedDevice`, supplied through `runtimes.doubles.device_seam`
to `runtimes.pytorch.device_seam`: no product module imports this one), and `load_model`
hands every model it loads to `emulate_forward`: the model is loaded and watched as
usual, and every CPU step of its adapter runs for real (decode, parse, tokenize, pad,
pool, results, the frames to and from the worker); only the model's own forward is
replaced by a wait of what the profile says the device would take,

    fixed_ms + per_token_us x padded tokens  (padded tokens = rows x columns of input_ids)

returning zeros of the shape and dtype the adapter reads (viewed from a cached buffer, so
a pass allocates nothing that grows with it). The wait sleeps until a `perf_counter`
deadline, never less, and `time.sleep` releases the GIL: like a GPU, the "device" leaves
the CPU to the other threads while it computes. The device clock (`device_time`) counts
the time asked, not how late the wait woke up (on a busy host, the scheduler and the
GIL held by the runtime's other threads wake it up to milliseconds late: the host's delay,
not the device's, which CUDA events would not count either), so `batch.device_ms` and
`shoal_device_busy_seconds_total` read as on a device of the profile's speed.

The device is a queue, as a CUDA stream is: a pass starts when the one before it ends
(or when it is called, if later; `runtimes.doubles.device_queue`). Inside
`queued_passes()` a pass returns at once and the host waits for it where it reads the
outputs (`wait_queued`, called by `runtimes.pytorch.text.HostCopy`, the pipelined dense
adapter's copy to the host); so a host thread that wakes late from one batch's wait does
not idle the device when the next batch was already queued behind it, as on a GPU.
Outside it (the other families, which read their outputs at once) a pass waits until its
own end. This is what DESIGN.md "Feeding the device" asks for: on a machine without a
GPU, does the CPU side keep a device of a given speed busy, and how many cores does that
take (`bench/device_feed.py` measures it).

Results are zeros, not the model's: a process that emulates logs a WARNING per model and
`emulation_stamp()` says so (the host marks the results `simulated` with it). Families it
emulates: text encoders loaded as AutoModel (dense, multivector), AutoModelForMaskedLM
(sparse), AutoModelForSequenceClassification (cross-encoder, sequence-classification,
zero-shot) and AutoModelForTokenClassification; anything else (causal LMs, CLIP) fails
its load with a ValueError that says so. It emulates on the CPU path only: on CUDA the
device clock times kernels, and a wait launches none.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)
from transformers.modeling_outputs import (
    BaseModelOutput,
    MaskedLMOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)

from runtimes.doubles.device_queue import make_stream, wait_until
from runtimes.doubles.profiles import ENV, DeviceProfile, configured_profile
from runtimes.pytorch import device_seam
from runtimes.pytorch.device_time import DeviceClock, device_clock

log = logging.getLogger(__name__)


# --- what the emulated passes asked for and waited --------------------------------------------


@dataclass(frozen=True, slots=True)
class EmulatedTotals:
    """Emulated forward passes of this process, summed (see `totals`)."""

    passes: int = 0
    padded_tokens: int = 0
    requested_s: float = 0.0  # what the profile asked the passes to take
    waited_s: float = 0.0  # how long after their call they ended (queue + pass + late)


_totals = EmulatedTotals()
_totals_lock = threading.Lock()
_loaded: DeviceProfile | None = None  # the profile of the last model emulated here


def totals() -> EmulatedTotals:
    return _totals


def reset() -> None:
    """Zero the totals and forget the models emulated so far (tests: the next load decides)."""
    global _totals, _loaded, _stream
    with _totals_lock:
        _totals = EmulatedTotals()
        _loaded = None
        _stream = make_stream()


def _count(tokens: int, requested_s: float, waited_s: float) -> None:
    global _totals
    with _totals_lock:
        t = _totals
        _totals = EmulatedTotals(t.passes + 1, t.padded_tokens + tokens,
                                 t.requested_s + requested_s, t.waited_s + waited_s)


def emulation_stamp() -> dict[str, Any] | None:
    """What to mark this process's results with while its models run on an emulated device
    (the profile and its constants; `device` is what the gateway's X-Simulated header
    shows), or None when nothing here is emulated: neither a model loaded emulated nor
    SHOAL_EMULATE_DEVICE set."""
    profile = _loaded or configured_profile()
    if profile is None:
        return None
    return {"device": f"emulated:{profile.name}", "emulated": True, "profile": profile.name,
            "fixed_ms": profile.fixed_ms, "per_token_us": profile.per_token_us,
            "source": profile.source}


_stream = make_stream()
_queued = threading.local()  # per thread: inside queued_passes, and the last queued end


@contextmanager
def queued_passes() -> Iterator[None]:
    """Emulated passes called inside return at once, queued on the device (see the module
    doc); `wait_queued()` waits for the last of them. Without an emulated model, nothing."""
    _queued.depth = getattr(_queued, "depth", 0) + 1
    try:
        yield
    finally:
        _queued.depth -= 1


def queued_until() -> float | None:
    """When the passes this thread queued since the last call end (None: it queued none)."""
    until, _queued.until = getattr(_queued, "until", None), None
    return until


def wait_queued(until: float | None) -> None:
    """Wait (GIL released) until the passes of `queued_until()` have run."""
    if until is not None:
        wait_until(until)


# --- the forward ------------------------------------------------------------------------------


class EmulatedForward:
    """A model's forward on the emulated device: zeros of the right shape after a wait.

    `kind` is what the adapter reads: "hidden" (last_hidden_state, rows x columns x width),
    "token_logits" (rows x columns x width) or "sequence_logits" (rows x width)."""

    _OUTPUTS = {"hidden": BaseModelOutput, "token_logits": MaskedLMOutput,
                "sequence_logits": SequenceClassifierOutput}

    def __init__(self, profile: DeviceProfile, kind: str, width: int, dtype: torch.dtype,
                 output_class: type | None = None) -> None:
        self.profile = profile
        self.kind = kind
        self.width = width
        self.dtype = dtype
        self.output_class = output_class or self._OUTPUTS[kind]
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._unbilled = threading.local()  # per thread: see unbilled_s

    def _zeros(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A view of `shape` on a zero buffer that grows (by doubling) and is then reused."""
        size = math.prod(shape)
        with self._lock:
            buffer = self._buffers.get(device)
            if buffer is None or buffer.numel() < size:
                grown = max(size, 2 * (0 if buffer is None else buffer.numel()))
                with torch.inference_mode(False):
                    buffer = self._buffers[device] = torch.zeros(grown, dtype=self.dtype,
                                                                 device=device)
        return buffer[:size].view(shape)

    def __call__(self, input_ids: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        if input_ids is None:
            raise ValueError("the emulated device takes input_ids (rows x columns)")
        rows, columns = input_ids.shape
        tokens = rows * columns
        requested = self.profile.seconds(tokens)
        if self.kind == "sequence_logits":
            out = self.output_class(logits=self._zeros((rows, self.width), input_ids.device))
        elif self.kind == "hidden":
            out = self.output_class(
                last_hidden_state=self._zeros((rows, columns, self.width), input_ids.device))
        else:
            out = self.output_class(
                logits=self._zeros((rows, columns, self.width), input_ids.device))
        # The output is made inside the pass's time, not after it: the wait is what the
        # device takes, whatever making zeros costs (as long as that is less).
        ends = _stream.queue(started, requested)
        if getattr(_queued, "depth", 0):
            _queued.until = ends
        else:
            wait_until(ends)
        returned = time.perf_counter()
        # The device clock timed this call from about `started` to `returned`.
        self._unbilled.seconds = requested - (returned - started)
        _count(tokens, requested, max(returned, ends) - started)
        return out

    def unbilled_s(self) -> float:
        """What the device clock must add to its time of this thread's last pass to bill
        the time asked (negative: a wait that woke late, or a pass queued behind another;
        positive: a queued pass that returned at once). 0 once read."""
        unbilled = getattr(self._unbilled, "seconds", 0.0)
        self._unbilled.seconds = 0.0
        return unbilled


def _text_encoder(config: Any) -> bool:
    """A config of a plain text encoder (BERT-like): no vision tower, no decoder."""
    return (not getattr(config, "is_encoder_decoder", False)
            and not getattr(config, "is_decoder", False)
            and not any(hasattr(config, k) for k in ("vision_config", "text_config"))
            and not any(a.endswith(("CausalLM", "ForConditionalGeneration"))
                        for a in getattr(config, "architectures", None) or ())
            and isinstance(getattr(config, "hidden_size", None), int))


SUPPORTED = ("AutoModel text encoders (dense, multivector), AutoModelForMaskedLM (sparse), "
             "AutoModelForSequenceClassification (cross-encoder, sequence-classification, "
             "zero-shot), AutoModelForTokenClassification (token-classification)")


def _forward_for(model: torch.nn.Module, model_class: Any, ref: str,
                 profile: DeviceProfile) -> EmulatedForward:
    config = model.config
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    if model_class is AutoModel and _text_encoder(config):
        return EmulatedForward(profile, "hidden", int(config.hidden_size), dtype)
    if model_class is AutoModelForMaskedLM:
        return EmulatedForward(profile, "token_logits", int(config.vocab_size), dtype)
    if model_class is AutoModelForTokenClassification:
        return EmulatedForward(profile, "token_logits", int(config.num_labels), dtype,
                               TokenClassifierOutput)
    if model_class is AutoModelForSequenceClassification:
        return EmulatedForward(profile, "sequence_logits", int(config.num_labels), dtype)
    raise ValueError(
        f"{ENV}={profile.name}: the emulated device cannot emulate {ref}, loaded as "
        f"{getattr(model_class, '__name__', model_class)} ({type(model).__name__}); it emulates "
        f"{SUPPORTED} (not causal-lm or clip). Unset {ENV} to serve it on the real model.")


def emulate_forward(model: torch.nn.Module, model_class: Any, ref: str) -> DeviceProfile | None:
    """Replace `model`'s forward by the emulated device's when SHOAL_EMULATE_DEVICE is set
    (the profile; None, the model untouched, when it is not). Called by `load_model` after
    the device clock is attached: the clock's hooks run around `model(...)`, which calls
    the instance's `forward`, so the wait counts as device time.

    ValueError (the load fails) for a family it cannot emulate, or a model not on the CPU."""
    global _loaded
    profile = configured_profile()
    if profile is None:
        return None
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type != "cpu":
        raise ValueError(f"{ENV}={profile.name}: the emulated device runs on the CPU path "
                         f"(SHOAL_DEVICE=cpu); {ref} is on {device}, whose clock times kernels")
    forward = _forward_for(model, model_class, ref, profile)
    model.forward = forward  # an instance attribute: nn.Module.__call__ runs it, hooks and all
    clock = device_clock(device)
    # After the clock's own hook (hooks run in the order registered): the device was busy
    # for the time asked; a wake-up after that (the scheduler, the GIL held by the
    # runtime's other threads) is the host's, as CUDA events would not count it either,
    # and a queued pass that returned at once still took its time.
    model.register_forward_hook(lambda *_: _bill(clock, forward.unbilled_s()))
    _loaded = profile
    if torch.get_num_threads() > 1:
        # What torch still computes here is what a GPU would run after the forward (pooling
        # the zeros): a few kernel launches there. Intra-op threads would only make it
        # contend with the pipeline for the cores (10x slower than one thread on 2 busy
        # cores, measured), billing the CPU side for the device's work.
        log.warning("EMULATED device: torch intra-op threads %d -> 1", torch.get_num_threads())
        torch.set_num_threads(1)
    log.warning("EMULATED device %s: %s computes nothing; each forward pass waits %g ms + "
                "%g us per padded token and returns zeros (%s). Results are not the model's.",
                profile.name, ref, profile.fixed_ms, profile.per_token_us, profile.source)
    return profile


def _bill(clock: DeviceClock, seconds: float) -> None:
    """Add `seconds` (here: what the clock's own timing of a pass missed, or took too
    much) to the busy time `clock` has not yet handed out."""
    clock.bill(seconds)


def emulated_profile(model: torch.nn.Module) -> DeviceProfile | None:
    """The profile `model` runs on when emulated, else None."""
    forward = model.__dict__.get("forward")
    return forward.profile if isinstance(forward, EmulatedForward) else None



# --- the hook: the PyTorch engine's device seam -----------------------------------------------


class EmulatedDevice:
    """This module as the engine's `runtimes.pytorch.device_seam.DeviceSeam`."""

    def replaces_forward(self) -> bool:
        return configured_profile() is not None

    def loaded(self, model: Any, model_class: Any, ref: str) -> None:
        emulate_forward(model, model_class, ref)

    def queued(self) -> AbstractContextManager[None]:
        return queued_passes()

    def queued_until(self) -> float | None:
        return queued_until()

    def wait_queued(self, until: float | None) -> None:
        wait_queued(until)

    def stamp(self) -> dict[str, Any] | None:
        return emulation_stamp()


def install() -> None:
    """Make this the engine's device seam (`device_seam.configured` does when
    SHOAL_EMULATE_DEVICE is set; benchmarks and tests may too)."""
    device_seam.install(EmulatedDevice())
