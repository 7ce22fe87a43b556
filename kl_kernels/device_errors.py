"""Bad values found on an accelerator, reported without a host sync and without killing the CUDA context.

The value checks of accelerator tensors (``offsets``, ``lengths``, ``prompt_lens``, ``token_logprobs``'
labels) cannot read the values on the host without a synchronization. Instead a kernel that finds a bad
value records it in the device's **error word**: ``codes.ERROR_WORD_SLOTS`` int64 in host-mapped pinned
memory (``cudaHostAlloc(cudaHostAllocMapped | cudaHostAllocPortable)``, one per device, allocated on first
use and kept for the process). The first kernel to claim it (an integer ``atomicCAS`` on slot ``claim``)
writes what it found (argument, kind, index, value, bound), then slot ``kind`` last, after a system-wide
fence; the other kernels leave it alone (first error wins). Nothing asserts: the kernels clamp every index
they derive from such values (memory-safe under any value) and write NaN into the outputs of the affected
sequences, and the CUDA context stays usable.

When the error surfaces:

* at the next call of ours on that device: it reads slot ``kind`` with a plain read of host memory (no
  sync), and if set raises the ``ValueError`` the host check gives for the same input (the message comes
  from :func:`value_error_message`, which the host checks use too) and clears the word;
* or at :func:`kl_kernels.check_errors` (:mod:`kl_kernels.value_checks`, which also launches the checks a
  validation deferred), which synchronizes the current stream of the device first.

Until then the outputs of the bad call hold NaN for the affected sequences (never values that pass for
results). CUDA-graph safe: the word's address is fixed for the process, so a captured kernel records into
it on every replay; no host sync anywhere. Triton kernels store into :attr:`ErrorWord.tensor`, a CUDA
tensor over the same mapped memory (``__cuda_array_interface__``).

CPU tensors (the cuda-emulated backend, Triton's interpreter) get a plain CPU int64 tensor as their word:
the same kernels record into it by the same code, so the error path is tested without a GPU.

The lowest floor of the value checks (``tests/test_structure.py``): it imports only :mod:`kl_kernels.codes`
and :mod:`kl_kernels._extensions`; :mod:`kl_kernels.value_checks` (where the checks run) stands on it.
"""

from __future__ import annotations

import ctypes

import torch

from . import codes

__all__ = ["ErrorWord", "word", "raise_pending", "value_error_message", "record_where"]

_SLOT = codes.ERROR_SLOTS
_KIND_NAMES = {code: name for name, code in codes.VALUE_ERROR_CODES.items()}
_ARG_NAMES = {code: name for name, code in codes.ARG_CODES.items()}


# What prompt_lens are bounded by (slot "extra" of an above_sequence error): a packed batch's sequence
# lengths, a padded one's lengths, or its width T.
SEQUENCE_BOUNDS = ("the sequence lengths", "lengths", "T")


def value_error_message(kind: str, name: str, value=None, bound=None, extra=None, index=None) -> str:
    """The message of a bad value: the one text for the host checks and for the device's error word.

    ``kind``: a key of ``codes.VALUE_ERROR_CODES``; ``name``: the argument; ``value``: the bad value;
    ``bound``: the limit it broke (offsets: N; lengths: T; prompt_lens: its sequence's length; labels: V;
    a nested argument's sequence length (lengths_mismatch, ``value``): log_probs' one);
    ``index``: where (prompt_lens: the sequence); ``extra``: labels' ``ignore_index``, prompt_lens' kind of
    bound (an index into ``SEQUENCE_BOUNDS``)."""
    if kind == "offsets_start":
        return f"{name} must start at 0, got {name}[0] = {value}"
    if kind == "offsets_decreasing":
        return f"{name} must be non-decreasing (sequence lengths >= 0)"
    if kind == "offsets_end":
        return f"{name} must end at the number of tokens N = {bound}, got {name}[-1] = {value}"
    if kind == "below_zero":
        return f"{name} must be >= 0, got {value}"
    if kind == "above_bound":
        return f"{name} must be <= T = {bound} (the padded width), got a length of {value}"
    if kind == "above_sequence":
        what = SEQUENCE_BOUNDS[int(extra or 0)]
        what = f"T = {bound}" if what == "T" else what
        return f"{name} must be <= {what}: sequence {index} has {name} {value} but only {bound} tokens"
    if kind == "lengths_mismatch":
        return (f"{name} must have the sequence lengths of log_probs: sequence {index} has {value} tokens in {name} "
                f"but {bound} in log_probs")
    if kind == "label_range":
        return (f"{name} must be in [0, {bound}) (the vocabulary) or ignore_index={extra} "
                f"at counted tokens, got {value}")
    raise AssertionError(f"unknown value error kind {kind!r}")


class _CudaArray:
    """A ``__cuda_array_interface__`` over the mapped word, so ``torch.as_tensor`` views it as a CUDA tensor."""

    def __init__(self, address: int):
        self.__cuda_array_interface__ = {"shape": (codes.ERROR_WORD_SLOTS,), "typestr": "<i8",
                                         "data": (address, False), "version": 3, "strides": None}


class ErrorWord:
    """One device's error word: ``host`` (where the host reads it), ``address`` (where kernels write it;
    the same memory) and ``tensor`` (an int64 ``[ERROR_WORD_SLOTS]`` tensor on the device over it, for
    Triton kernels and torch operations)."""

    __slots__ = ("device", "host", "address", "tensor", "_keep", "kind")

    def __init__(self, device: torch.device, host: int, address: int, tensor: torch.Tensor, keep=None):
        self.device, self.host, self.address, self.tensor, self._keep = device, host, address, tensor, keep
        # the slot that says whether anything is recorded (0: nothing), read by raise_pending at every call of
        # ours: one attribute read instead of a method and a ctypes view per read (None: no host memory)
        self.kind = self._slot("kind") if host else None

    def _slot(self, name: str) -> ctypes.c_int64:
        return ctypes.c_int64.from_address(self.host + 8 * _SLOT[name])

    def pending(self) -> bool:
        return self.host != 0 and self._slot("kind").value != 0

    def take(self) -> dict | None:
        """What was recorded (kind, arg, index, value, bound, extra), clearing the word; None if nothing."""
        kind = self._slot("kind").value if self.host else 0
        if kind == 0:
            return None
        got = {s: self._slot(s).value for s in ("arg", "index", "value", "bound", "extra")}
        for s in ("kind", "arg", "index", "value", "bound", "extra"):
            self._slot(s).value = 0
        self._slot("claim").value = 0  # last: a kernel may claim it again from here on
        got["kind"] = _KIND_NAMES.get(kind, str(kind))
        got["arg"] = _ARG_NAMES.get(got["arg"], "") or "an index argument"
        return got


_WORDS: dict[tuple[str, int | None], ErrorWord] = {}


def _key(device) -> tuple[str, int | None]:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device.type, device.index


def word(device) -> ErrorWord:
    """The error word of ``device`` (created on first use, kept for the process)."""
    key = _key(device)
    found = _WORDS.get(key)
    if found is not None:
        return found
    dev = torch.device(*key) if key[1] is not None else torch.device(key[0])
    if key[0] == "cuda" and torch.cuda.is_available():
        from . import _extensions  # not at import time: the package imports without extensions

        module = _extensions.load("_cuda")[0]
        if module is not None:  # mapped, portable pinned memory (csrc/cuda/ragged_checks.cu)
            host, address = module.error_word_alloc(key[1])
            if host == 0:
                raise RuntimeError(f"kl_kernels: cudaHostAlloc of the error word on {dev} failed")
            keep = None
        else:  # no _cuda (Triton alone): torch's pinned memory, which unified addressing maps at the same address
            keep = torch.zeros(codes.ERROR_WORD_SLOTS, dtype=torch.int64).pin_memory()
            host = address = keep.data_ptr()
        tensor = torch.as_tensor(_CudaArray(address), device=dev)
        found = ErrorWord(dev, host, address, tensor, keep)
    elif key[0] == "cuda":  # fake CUDA tensors on a CPU-only torch (tests/test_no_host_sync.py): traced, not kept
        return ErrorWord(dev, 0, 0, torch.zeros(codes.ERROR_WORD_SLOTS, dtype=torch.int64, device=dev))
    else:  # CPU tensors (cuda-emulated, Triton's interpreter): host memory is the device's
        tensor = torch.zeros(codes.ERROR_WORD_SLOTS, dtype=torch.int64, device=dev)
        found = ErrorWord(dev, tensor.data_ptr(), tensor.data_ptr(), tensor, keep=tensor)
    _WORDS[key] = found
    _BY_ARGUMENT.clear()  # (it may remember this device as having no word)
    return found


# raise_pending's lookups by the ``device`` argument itself (a torch.device, a string, an ErrorWord): the
# word or None, for arguments whose meaning does not depend on the current CUDA device. It runs at every
# call of ours (twice in a planned one), so a hit costs one dict read; word() clears it when it adds a word.
_BY_ARGUMENT: dict = {}


def _word_of(device) -> "ErrorWord | None":
    """raise_pending's slow lookup: the existing word of ``device`` (or ``device`` itself, an ErrorWord),
    remembered in _BY_ARGUMENT unless ``device`` means "the current CUDA device"."""
    if isinstance(device, ErrorWord):
        found = device
    else:
        key = _key(device)
        found = _WORDS.get(key)
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            return found
    try:
        _BY_ARGUMENT[device] = found
    except TypeError:  # (unhashable: looked up every time)
        pass
    return found


def raise_pending(device) -> None:
    """Raise the ValueError recorded on ``device``'s error word, if any, and clear it. A plain read of host
    memory: no sync (an error still being recorded by a running kernel surfaces at a later call)."""
    try:
        found = _BY_ARGUMENT[device]
    except (KeyError, TypeError):
        found = _word_of(device)
    if found is None or found.kind is None or found.kind.value == 0:  # (nothing recorded: no call)
        return
    got = found.take()
    if got is not None:
        raise ValueError(value_error_message(got["kind"], got["arg"], got["value"], got["bound"], got["extra"],
                                             got["index"])
                         + f" (found on {found.device} by an earlier kl_kernels call, at index {got['index']})")


def record_where(bad: torch.Tensor, values: torch.Tensor, kind: str, arg: str, bound, extra=0) -> None:
    """Record, with torch operations (no sync), the first element of ``values`` where ``bad`` holds in the
    error word of their device, unless one is recorded already: for checks that have no kernel of ours
    (the torch backend on CUDA, or no ``_cuda`` extension). ``bound``: an int or a tensor like ``values``."""
    w = word(values.device).tensor
    flat = bad.reshape(-1)
    if flat.numel() == 0:
        return
    at = flat.to(torch.uint8).argmax()  # the first True (0 when none, then not taken)
    value = values.reshape(-1).to(torch.int64).index_select(0, at.reshape(1)).reshape(())
    if isinstance(bound, torch.Tensor):
        bound = bound.reshape(-1).to(torch.int64).index_select(0, at.reshape(1)).reshape(())
    else:
        bound = torch.full((), int(bound), dtype=torch.int64, device=values.device)
    fields = [torch.ones((), dtype=torch.int64, device=values.device),
              torch.full((), codes.VALUE_ERROR_CODES[kind], dtype=torch.int64, device=values.device),
              torch.full((), codes.ARG_CODES.get(arg, 0), dtype=torch.int64, device=values.device),
              at.to(torch.int64), value, bound, torch.full((), int(extra), dtype=torch.int64, device=values.device)]
    new = torch.stack(fields + [torch.zeros((), dtype=torch.int64, device=values.device)] *
                      (codes.ERROR_WORD_SLOTS - len(fields)))
    take = flat.any() & w.select(0, _SLOT["kind"]).eq(0)
    # (out=: in place, element by element; Tensor.copy_ would do the same but a CPU-only torch refuses it on the
    # fake CUDA tensors of tests/test_no_host_sync.py, which run this without a GPU)
    torch.where(take, new, w, out=w)
