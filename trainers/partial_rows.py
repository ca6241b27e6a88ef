"""The pool's dataset rows in checkpoints (trainers/partial_rollouts.py GroupPool.state_dict): encoded as plain
lists and dicts that torch.load(weights_only=True) reads, whatever ordinary types the dataset's columns hold."""
from __future__ import annotations

_TAG = "__rlspec_value__"  # a dict holding this key encodes one value of a type a weights_only load refuses


def encode_rows(value):
    """`value` (dataset rows: dicts, lists, tuples, str, numbers, None, tensors, datetime / date / time /
    timedelta, Decimal, numpy scalars and arrays, nested) as plain lists and dicts that torch.load(weights_only=True)
    reads; decode_rows gives it back equal. A type it does not know is refused when the checkpoint is written (not
    when it is resumed), naming the type."""
    import datetime
    import decimal

    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return {_TAG: "dict", "items": [[encode_rows(k), encode_rows(v)] for k, v in value.items()]}
        return {k: encode_rows(v) for k, v in value.items()}
    if isinstance(value, list):
        return [encode_rows(v) for v in value]
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [encode_rows(v) for v in value]}
    for kind in (datetime.datetime, datetime.date, datetime.time):  # datetime first: it is a date too
        if isinstance(value, kind):
            return {_TAG: kind.__name__, "iso": value.isoformat()}
    if isinstance(value, datetime.timedelta):
        return {_TAG: "timedelta", "s": [value.days, value.seconds, value.microseconds]}
    if isinstance(value, decimal.Decimal):
        return {_TAG: "decimal", "s": str(value)}
    module = type(value).__module__
    if module == "numpy":
        import numpy as np

        if isinstance(value, np.ndarray) and value.dtype != object:
            return {_TAG: "ndarray", "dtype": value.dtype.str, "shape": list(value.shape),
                    "data": value.tobytes()}
        if isinstance(value, np.ndarray):
            return {_TAG: "ndarray-object", "shape": list(value.shape), "items": [encode_rows(v) for v in
                                                                                   value.ravel().tolist()]}
        if isinstance(value, np.generic):
            return {_TAG: "numpy", "dtype": value.dtype.str, "data": value.tobytes()}
    if module.startswith("torch") and type(value).__name__ in ("Tensor", "Parameter"):
        return value.detach().cpu()
    raise TypeError(f"partial rollouts: a dataset row holds a {module}.{type(value).__name__}, which the pool's "
                    "checkpoint cannot store safely; convert that column to str, numbers, lists, dicts, datetime or "
                    "numpy values (or drop it from train_dataset)")


def decode_rows(value):
    """encode_rows' inverse."""
    import datetime
    import decimal

    if isinstance(value, list):
        return [decode_rows(v) for v in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(_TAG)
    if kind is None:
        return {k: decode_rows(v) for k, v in value.items()}
    if kind == "dict":
        return {decode_rows(k): decode_rows(v) for k, v in value["items"]}
    if kind == "tuple":
        return tuple(decode_rows(v) for v in value["items"])
    if kind in ("datetime", "date", "time"):
        return getattr(datetime, kind).fromisoformat(value["iso"])
    if kind == "timedelta":
        return datetime.timedelta(*value["s"])
    if kind == "decimal":
        return decimal.Decimal(value["s"])
    import numpy as np

    if kind == "ndarray":
        return np.frombuffer(value["data"], dtype=np.dtype(value["dtype"])).reshape(value["shape"]).copy()
    if kind == "ndarray-object":
        out = np.empty(len(value["items"]), dtype=object)
        out[:] = [decode_rows(v) for v in value["items"]]
        return out.reshape(value["shape"])
    if kind == "numpy":
        return np.frombuffer(value["data"], dtype=np.dtype(value["dtype"]))[0]
    raise ValueError(f"partial rollouts: a checkpoint's pool holds an encoded value of unknown kind {kind!r}")
