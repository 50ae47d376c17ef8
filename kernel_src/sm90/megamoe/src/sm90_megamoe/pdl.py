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
virtual ranks of one GPU can never starve each other of SM slots.
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
