"""Read machine code (SASS, ``cuobjdump -sass``) for what a kernel's main loop costs per entry it handles.

Shared by the CUDA C++ kernels' paper model (``gpu_model``) and the Triton kernels' static records
(``kl_kernels.triton.aot``), so that both count the same way:

* a *loop* is the address range from a backward branch's target to the branch;
* a kernel's *main loop* is, of the innermost loops that load from global memory (no such loop inside
  them: a row loop around the entries' loop is not one), the one that loads the most bits per iteration;
* its cost is every instruction in that range but ``NOP``, counted once per iteration, whether or not a
  branch inside skips it (so a rarely taken rebase counts in full: an upper bound for a hot loop whose
  cold paths the compiler kept inline); and ``path``, the fewest instructions from the loop's first to its
  backward branch, every branch inside taken or not as makes it shortest: the steady state of a loop whose
  only branches go around rare work (a rebase when a max rises, a label's vector), as the CUDA row kernels'
  main loops are written (their partial last steps sit after the loop), and too low for a loop that
  branches around work it does every time.

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
    predicated: bool = False  # guarded by a predicate (@P0, @!P1): a branch that may fall through


@dataclass
class Loop:
    start: int
    end: int  # the backward branch's address
    instructions: int
    load_bits: int            # global load bits per iteration (each LDG counted once)
    ops: Counter = field(default_factory=Counter)  # opcode (without modifiers) -> count
    path: int = 0             # the fewest instructions through one iteration (the module's docstring)

    def per_entry(self, entry_bits: int, streams: int = 1, steady: bool = False) -> float:
        """Instructions per entry for rows of `entry_bits`-bit entries, `streams` rows read side by side: the
        whole loop's, or (steady) its shortest path's."""
        entries = self.load_bits / (entry_bits * streams)
        return (self.path if steady else self.instructions) / entries if entries else float("inf")


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
            guard = m.group(2) or ""
            current.append(Instr(int(m.group(1), 16), m.group(3), m.group(4).strip(), bool(guard) and "PT" not in guard))
    return out


def load_bits(op: str) -> int:
    """Bits one global load moves (``LDG.E.128`` -> 128, ``LDG.E`` -> 32); 0 for anything else."""
    parts = op.split(".")
    if parts[0] != "LDG":
        return 0
    return next((_WIDTH[p] for p in parts[1:] if p in _WIDTH), 32)


def _target(ins: Instr) -> int | None:
    if ins.op.split(".")[0] != "BRA":
        return None
    m = re.search(r"(0x[0-9a-f]+)", ins.operands)
    return int(m.group(1), 16) if m else None


def _shortest(body: list[Instr]) -> int:
    """The fewest instructions from body[0] to body[-1] along forward edges: the fall-through (not after an
    unguarded BRA or EXIT) and a branch's target inside the body."""
    index = {ins.addr: k for k, ins in enumerate(body)}
    best = [None] * len(body)
    best[0] = 1
    for k, ins in enumerate(body[:-1]):
        if best[k] is None:
            continue
        nexts = [] if ins.op.split(".")[0] in ("BRA", "EXIT") and not ins.predicated else [k + 1]
        t = _target(ins)
        if t is not None and index.get(t, -1) > k:
            nexts.append(index[t])
        for n in nexts:
            best[n] = best[k] + 1 if best[n] is None else min(best[n], best[k] + 1)
    return best[-1] if best[-1] is not None else len(body)


def loops(instrs: list[Instr]) -> list[Loop]:
    """Every loop of a function (a backward branch and its target), with what its range holds."""
    out = []
    for ins in instrs:
        target = _target(ins)
        if target is None or target > ins.addr:
            continue
        body = [i for i in instrs if target <= i.addr <= ins.addr and i.op != "NOP"]
        ops = Counter(i.op.split(".")[0] for i in body)
        out.append(Loop(target, ins.addr, len(body), sum(load_bits(i.op) for i in body), ops, _shortest(body)))
    return out


def inner_loading_loops(instrs: list[Instr]) -> list[Loop]:
    """The loops that load from global memory with no such loop inside them (a row loop around the entries'
    loop is not one), in address order."""
    found = [lp for lp in loops(instrs) if lp.load_bits > 0]
    return [lp for lp in found if not any(o is not lp and lp.start <= o.start and o.end <= lp.end for o in found)]


def pick_main(inner: list[Loop]) -> Loop | None:
    """Of inner loading loops, the one that loads the most bits per iteration (of equals, the one with the
    fewest, widest loads: a kernel's vector walk rather than its entry-by-entry variant; then the smallest)."""
    return max(inner, key=lambda lp: (lp.load_bits, -lp.ops["LDG"], -(lp.end - lp.start)), default=None)


def main_loop(instrs: list[Instr]) -> Loop | None:
    """The main loop: ``pick_main`` of ``inner_loading_loops`` (None: no loop loads anything)."""
    return pick_main(inner_loading_loops(instrs))
