"""The one table of codes and numeric bounds shared by Python, the C++/CUDA kernels and Triton.

Every code that crosses the Python/kernel boundary (estimators, placements, layouts, dtypes,
coefficient modes) and every numeric bound the kernels and the references share is written here and
only here. ``csrc/common/codes.h`` is generated from this file (``python -m kl_kernels.codes
--write``); ``tests/test_codes.py`` regenerates it and fails on any difference, so the C++ side can
never drift. Triton kernels take these values as ``tl.constexpr`` arguments from their launchers.

This module imports nothing but the standard library (the build and the header generator use it
without torch); dtypes are named by their torch attribute names.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Estimator names callers pass, and the base estimator each one computes (the "+" variants keep the
# base's value with k2's gradient: straight-through).
ESTIMATORS = ("k1", "abs", "k2", "k3", "k1+", "abs+", "k2+", "k3+")
STRAIGHT_THROUGH = frozenset({"k1+", "abs+", "k2+", "k3+"})
ESTIMATOR_CODES = {"k1": 0, "abs": 1, "k2": 2, "k3": 3}              # enum Estimator

PLACEMENT_CODES = {None: 0, "token": 1, "sequence": 2, "last": 3, "last_valid": 4}  # enum Placement (None: no reward)
# kl_reward's reward_placement values as callers pass them
PLACEMENTS = ("auto", "token", "sequence", "last", "last_valid")
LAYOUT_CODES = {"packed": 0, "padded": 1}                            # enum Layout
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}            # enum DType (torch attribute names)
COEF_MODE_CODES = {"scalar": 0, "tensor0d": 1, "per_sequence": 2}    # enum CoefMode

# |lp - old| bound of the PPO ratio: exp(20) ~ 4.9e8 keeps ratio * advantage finite in float32.
LOG_RATIO_BOUND = 20.0

# The row ops (token_logprobs, full_kl): lse - z beyond this has e^(z - lse) == 0 in float32 (the kernels'
# exp flushes below e^-87.3), so clamping it there keeps 0 * inf (a -inf logit) out of the terms weighted by a
# probability (the entropy's p (lse - z)). csrc/common/row_math.h and the Triton row kernels read it.
ROW_FAR = 88.0

# Bad values found on the device (kl_kernels/device_errors.py): a kernel that finds one records it in the
# device's error word instead of asserting, and the next call of ours on that device (or
# kl_kernels.check_errors()) raises the ValueError the host check gives for the same input. The word is
# ERROR_WORD_SLOTS int64 in host-mapped memory; the first kernel to claim it (an integer atomicCAS on slot
# "claim") writes what it found, then "kind" last, which the host polls.
ERROR_WORD_SLOTS = 8
ERROR_SLOTS = {"claim": 0, "kind": 1, "arg": 2, "index": 3, "value": 4, "bound": 5, "extra": 6}
# what was wrong (0: nothing recorded)
VALUE_ERROR_CODES = {"none": 0, "offsets_start": 1, "offsets_decreasing": 2, "offsets_end": 3, "below_zero": 4,
                     "above_bound": 5, "above_sequence": 6, "label_range": 7, "lengths_mismatch": 8}
# which argument held it (0: unnamed); from 5 on, the nested per-token arguments whose sequence lengths must be
# log_probs' (lengths_mismatch, recorded by torch operations in kl_kernels/layouts.py: no kernel reads these)
ARG_CODES = {"": 0, "offsets": 1, "lengths": 2, "prompt_lens": 3, "labels": 4, "ref_log_probs": 5,
             "old_log_probs": 6, "mask": 7, "reward": 8, "advantages": 9, "entropy": 10, "weights": 11,
             "log_probs.offsets()": 12}  # (12: a jagged nested log_probs' own offsets, checked as offsets)

_ENUMS = (
    ("Estimator", {"kK1": 0, "kAbs": 1, "kK2": 2, "kK3": 3}),
    ("Placement", {"kNoReward": 0, "kToken": 1, "kSequence": 2, "kLast": 3, "kLastValid": 4}),
    ("Layout", {"kPacked": 0, "kPadded": 1}),
    ("DType", {"kFloat32": 0, "kBFloat16": 1, "kFloat16": 2}),
    ("CoefMode", {"kCoefScalar": 0, "kCoefTensor0d": 1, "kCoefPerSeq": 2}),
    ("ErrorSlot", {"kSlotClaim": 0, "kSlotKind": 1, "kSlotArg": 2, "kSlotIndex": 3, "kSlotValue": 4,
                   "kSlotBound": 5, "kSlotExtra": 6}),
    ("ValueErrorKind", {"kErrNone": 0, "kErrOffsetsStart": 1, "kErrOffsetsDecreasing": 2, "kErrOffsetsEnd": 3,
                        "kErrBelowZero": 4, "kErrAboveBound": 5, "kErrAboveSequence": 6, "kErrLabelRange": 7,
                        "kErrLengthsMismatch": 8}),
    ("ArgCode", {"kArgNone": 0, "kArgOffsets": 1, "kArgLengths": 2, "kArgPromptLens": 3, "kArgLabels": 4,
                 "kArgRefLogProbs": 5, "kArgOldLogProbs": 6, "kArgMask": 7, "kArgReward": 8, "kArgAdvantages": 9,
                 "kArgEntropy": 10, "kArgWeights": 11, "kArgNestedOffsets": 12}),
)

# The C++ names above are spelled out for readability; they must carry this table's values.
_SOURCES = {"Estimator": ESTIMATOR_CODES, "Placement": PLACEMENT_CODES, "Layout": LAYOUT_CODES,
            "DType": DTYPE_CODES, "CoefMode": COEF_MODE_CODES, "ErrorSlot": ERROR_SLOTS,
            "ValueErrorKind": VALUE_ERROR_CODES, "ArgCode": ARG_CODES}


def header() -> str:
    """The text of ``csrc/common/codes.h``."""
    for enum, members in _ENUMS:
        # the C++ names in the table's order carry the table's codes
        if list(members.values()) != list(_SOURCES[enum].values()):
            raise AssertionError(f"codes.py: the C++ names of {enum} do not match its codes")
    lines = ["// GENERATED by `python -m kl_kernels.codes --write` from kl_kernels/codes.py: do not edit.",
             "// The codes and bounds shared by Python, the C++/CUDA kernels and Triton (tests/test_codes.py",
             "// regenerates this file and fails on any difference).",
             "#pragma once", "", "#include <cstdint>", "", "namespace kl {", ""]
    for enum, members in _ENUMS:
        items = [f"{name} = {code}" for name, code in members.items()]
        line = f"enum {enum} : int32_t {{ {', '.join(items)} }};"
        if len(line) <= 120:
            lines.append(line)
        else:  # one member a line (the repository's 120-column rule)
            lines += [f"enum {enum} : int32_t {{", *(f"  {item}," for item in items), "};"]
    lines += ["", f"constexpr float kLogRatioBound = {LOG_RATIO_BOUND!r}f;",
              f"constexpr float kRowFar = {ROW_FAR!r}f;  // the row ops' bound on lse - z (row_math.h)",
              f"constexpr int kErrorWordSlots = {ERROR_WORD_SLOTS};  // int64 slots of the error word", "",
              "}  // namespace kl", ""]
    return "\n".join(lines)


HEADER_PATH = Path(__file__).resolve().parents[1] / "csrc" / "common" / "codes.h"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--write"]:
        HEADER_PATH.write_text(header())
    else:
        sys.stdout.write(header())
    return 0


if __name__ == "__main__":
    sys.exit(main())
