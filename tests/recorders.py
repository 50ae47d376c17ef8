"""Recording stand-ins shared by the CPU wiring tests of the SM90 backends (no kernel runs)."""


def rec_layout(calls: list):
    """A recording stand-in for the layout session: the plain call, ``route`` and (drop v58)
    ``prepare_route``, whose run records the ``route`` call it stands for."""
    def prepare_route(self, ep, offsets, idx, ws, pos, xs):
        return lambda x, ids, w, tokens=None: calls.append(("route", (ep, x, ids, w, offsets, idx, ws, pos, xs),
                                                            {"tokens": tokens}))
    return type("L", (), {"__call__": lambda self, *a, **k: calls.append(("layout", a, k)),
                          "route": lambda self, *a, **k: calls.append(("route", a, k)),
                          "prepare_route": prepare_route})()
