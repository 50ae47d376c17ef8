"""Programmatic dependent launch (PDL) for every kernel of this drop.

A layer's forward is a chain of short kernels on one stream (dispatch, layout, GEMMs, combine).
Launched with ``use_pdl=PDL`` (on unless ``SM90_MEGAMOE_PDL=0``, see :data:`PDL`), a kernel's CTAs
may be scheduled before the previous kernel in the stream has finished, so the launch and CTA
start-up of kernel i+1 overlap the tail of kernel i.
Correctness is unchanged because every kernel's first statement is :func:`wait_previous_grid`:
``griddepcontrol.wait`` blocks until the previous grid has completed and its memory is visible
(a no-op when the kernel was launched without PDL), so nothing is read or written earlier.

``griddepcontrol.launch_dependents`` (issued right after the wait) lets the next kernel launch
before this one ends. Kernels that spin on other ranks' flags pass ``trigger=False`` (their
successor then launches as their CTAs exit): a successor's CTAs parked on SMs must only ever wait
for a grid that finishes on its own, never for one that waits on another rank, so that the
virtual ranks of one GPU can never starve each other of SM slots. LocalRoute triggers early only
for small grids (:func:`wait_previous_grid_trigger_if_small`, drop v90): an early trigger from a
full grid lets a successor of small CTAs be placed unevenly beside it.
"""

from __future__ import annotations

import os

import cutlass.cute as cute

# Whether every launch of this drop sets the PDL attribute
# (cudaLaunchAttributeProgrammaticStreamSerialization): on unless SM90_MEGAMOE_PDL=0 when the package
# is imported (compile-time; a host caching compiled kernels must key them on it). On by default since
# version 20: on the H200 it took 4-6 us off a Qwen3 decode step (with FC2's early weight prefetch),
# and the layer and virtual-rank GPU tests passed with it. Off, the waits below are no-ops and the
# kernels behave exactly as version 15's.
PDL = os.environ.get("SM90_MEGAMOE_PDL", "1") != "0"


def wait_previous_grid(trigger: bool = True) -> None:
    """First statement of every kernel: wait for the previous grid of the stream, then (``trigger``)
    allow the next one to launch."""
    cute.arch.griddepcontrol_wait()
    if trigger:
        cute.arch.griddepcontrol_launch_dependents()


@cute.jit
def wait_previous_grid_trigger_if_small() -> None:
    """:func:`wait_previous_grid` for a kernel whose successor gives each of its CTAs one fixed
    share of the work over about one CTA per SM (LocalRoute, then LayoutPlace): the early trigger
    only while this grid leaves at least half the SMs free (decode-sized grids).

    Why (drop v90, H200): triggered at the start of a full grid, LayoutPlace's CTAs were placed
    while LocalRoute's still held a slot on most SMs, so some SMs took two of them and others none.
    Eagerly the host's launch came late enough not to matter; replayed from a CUDA graph it came at
    once, and LayoutPlace took 120 us instead of 93 on Qwen3 (8192 tokens). Without the trigger the
    successor launches as this grid's CTAs exit, onto free SMs."""
    cute.arch.griddepcontrol_wait()
    gdim, _, _ = cute.arch.grid_dim()
    if gdim * 2 <= cute.arch.nsmid():
        cute.arch.griddepcontrol_launch_dependents()


WAIT_PTX = "griddepcontrol.wait"
TRIGGER_PTX = "griddepcontrol.launch_dependents"


def ptx_problems(ptx: str, trigger: bool = True) -> list:
    """What a kernel's PTX breaks of the contract above (empty when none): the wait is always
    there; the early trigger is there iff ``trigger``."""
    problems = [] if WAIT_PTX in ptx else [f"{WAIT_PTX} missing"]
    if trigger and TRIGGER_PTX not in ptx:
        problems.append(f"{TRIGGER_PTX} missing")
    if not trigger and TRIGGER_PTX in ptx:
        problems.append(f"{TRIGGER_PTX} in a kernel that spins on other ranks' flags")
    return problems
