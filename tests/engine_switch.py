"""Runs of one request with an engine switch on and then off (top rows vs whole rows, device vs host
grammar masks): the two ways the same tokens must come from, and how often the switched path ran."""


def on_then_off(model, switch: str, counter: str, run, check_off: bool = True):
    """run() with model._engine.<switch> on, then off (on again afterwards, whatever happens); returns
    both results and how much decode_stats[counter] grew during the first run. check_off: assert that
    the second run left the counter as it was (the switched-off path never ran)."""
    engine = model._engine
    before = engine.decode_stats[counter]
    try:
        setattr(engine, switch, True)
        on = run()
        n_on = engine.decode_stats[counter] - before
        setattr(engine, switch, False)
        off = run()
        if check_off:
            assert engine.decode_stats[counter] - before == n_on, f"the run with {switch} off grew {counter}"
    finally:
        setattr(engine, switch, True)
    return on, off, n_on
