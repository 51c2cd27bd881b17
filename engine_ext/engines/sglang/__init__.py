"""SGLang adapter: ``POST /update_weights_delta`` on SGLang servers, and the same for
in-process ``sglang.Engine`` users (:func:`update_weights_delta`). See docs/sglang.md."""


def update_weights_delta(engine, url: str, **fields) -> dict:
    from .engine import update_weights_delta as _update

    return _update(engine, url, **fields)


def delta_status(engine) -> dict:
    from .engine import delta_status as _status

    return _status(engine)
