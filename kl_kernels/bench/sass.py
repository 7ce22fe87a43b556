"""Read machine code (SASS, ``cuobjdump -sass``) for what a kernel's main loop costs per entry it handles.

Shared by the CUDA C++ kernels' paper model (``gpu_model``) and the Triton kernels' static records
(``kl_kernels.triton.aot``), so that both count the same way:

* a *loop* is the address range from a backward branch's target to the branch;
* a kernel's *main loop* is, of the innermost loops that load from global memory (no such loop inside
  them: a row loop around the entries' loop is not one), the one that loads the most bits per iteration;
* its cost is every instruction in that range but ``NOP``, counted once per iteration, whether or not a
  branch inside skips it (so a rarely taken rebase counts in full: an upper bound for a hot loop whose
  cold paths the compiler kept inline).

Per entry = instructions / (bits loaded per iteration / (bits per entry x streams)), e.g. a bf16 row read
through one ``LDG.E.128`` per iteration is 8 entries. The FP32 pipes of an SM issue 128 lanes a cycle, so
at the same clock an instruction count per entry is a floor on time that can be set against the bytes'
(``gpu_model``).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

_FUNCTION = re.compile(r"Function : (\S+)")
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_WIDTH = {"128": 128, "64": 64, "U16": 16, "S16": 16, "U8": 8, "S8": 8}


@dataclass
class Instr:
    addr: int
    op: str       # the opcode with its modifiers, e.g. "LDG.E.128.CONSTANT"
    operands: str


@dataclass
class Loop:
    start: int
    end: int  # the backward branch's address
    instructions: int
    load_bits: int            # global load bits per iteration (each LDG counted once)
    ops: Counter = field(default_factory=Counter)  # opcode (without modifiers) -> count

    def per_entry(self, entry_bits: int, streams: int = 1) -> float:
        """Instructions per entry for rows of `entry_bits`-bit entries, `streams` rows read side by side."""
        entries = self.load_bits / (entry_bits * streams)
        return self.instructions / entries if entries else float("inf")


def functions(sass: str) -> dict[str, list[Instr]]:
    """Each function's instructions, in address order, by mangled name."""
    out: dict[str, list[Instr]] = {}
    current = None
    for line in sass.splitlines():
        m = _FUNCTION.search(line)
        if m:
            current = out.setdefault(m.group(1), [])
            continue
        if current is None:
            continue
        m = _INSTR.search(line)
        if m:
            current.append(Instr(int(m.group(1), 16), m.group(3), m.group(4).strip()))
    return out


def load_bits(op: str) -> int:
    """Bits one global load moves (``LDG.E.128`` -> 128, ``LDG.E`` -> 32); 0 for anything else."""
    parts = op.split(".")
    if parts[0] != "LDG":
        return 0
    return next((_WIDTH[p] for p in parts[1:] if p in _WIDTH), 32)


def loops(instrs: list[Instr]) -> list[Loop]:
    """Every loop of a function (a backward branch and its target), with what its range holds."""
    out = []
    for ins in instrs:
        if ins.op.split(".")[0] != "BRA":
            continue
        m = re.match(r"(?:`?\(?\.?L?_?x?_?\d*\)?)?\s*(0x[0-9a-f]+)", ins.operands)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target > ins.addr:
            continue
        body = [i for i in instrs if target <= i.addr <= ins.addr and i.op != "NOP"]
        ops = Counter(i.op.split(".")[0] for i in body)
        out.append(Loop(target, ins.addr, len(body), sum(load_bits(i.op) for i in body), ops))
    return out


def main_loop(instrs: list[Instr]) -> Loop | None:
    """Of the innermost loops that load (no loading loop inside them), the one that loads the most bits per
    iteration (None: no loop loads anything)."""
    found = [lp for lp in loops(instrs) if lp.load_bits > 0]
    inner = [lp for lp in found if not any(o is not lp and lp.start <= o.start and o.end <= lp.end for o in found)]
    return max(inner, key=lambda lp: (lp.load_bits, -(lp.end - lp.start)), default=None)
