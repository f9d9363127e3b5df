"""The controller's wire format (:mod:`omnirl_async.buffer.rpc`): blobs each way, errors as values."""

import msgspec
import numpy as np
import pytest

from omnirl_async.buffer.rpc import Pickled, answer, guard, pack, packed, request, unpack


@pytest.mark.parametrize("dtype", ["<f4", "<f8", "<f2", "|b1", "|i1", "<i8", "|u1", "<u4"])
@pytest.mark.parametrize("shape", [(8, 3), (0, 5), (2, 1, 4), ()])
def test_arrays_round_trip_exactly_as_writable_copies(dtype, shape):
    rng = np.random.default_rng(0)
    x = np.asarray((rng.standard_normal(shape) * 50)).astype(dtype)  # shape (): a 0-d array
    got = unpack(pack({"x": x, "info": [x, 3]}))
    for y in (got["x"], got["info"][0]):
        assert y.dtype == x.dtype and y.shape == x.shape
        np.testing.assert_array_equal(y, x)
        assert y.flags.writeable and y.flags.owndata
    got["x"][...] = 0  # a copy: the sender's array is untouched
    assert got["info"][1] == 3


def test_non_contiguous_arrays_and_numpy_scalars():
    x = np.arange(24, dtype=np.int64).reshape(4, 6)[:, ::2]
    out = unpack(pack([x, np.int64(7), np.float32(0.5), np.bool_(True)]))
    np.testing.assert_array_equal(out[0], x)
    assert out[1:] == [7, 0.5, True] and type(out[1]) is int


def test_tuples_arrive_as_lists_and_bytes_as_bytes():
    wire = ("omnirl-ref", b"\x00\x01", b"owner", b"")
    assert unpack(pack([[b"metas", (wire, [0, 1, 2])]])) == [[b"metas", [list(wire), [0, 1, 2]]]]


def test_what_a_blob_cannot_carry_is_refused_by_name():
    with pytest.raises(TypeError, match="cannot send a object"):
        pack({"ref": object()})
    with pytest.raises(TypeError, match="cannot send a ndarray"):
        pack(np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match="unknown msgpack extension 9"):
        unpack(msgspec.msgpack.encode(msgspec.msgpack.Ext(9, b"x")))


def test_packed_replies_blob_or_error_and_answer_reverses_it():
    @packed
    def ok(v):
        return v

    @packed
    def fails():
        raise KeyError("no such key")

    @packed
    def pickled():
        return Pickled((object, 1))  # what a blob cannot carry, sent as guard would

    blob = ok([1, np.arange(3)])
    assert isinstance(blob, bytes)
    first, arr = answer(blob)
    assert first == 1 and arr.tolist() == [0, 1, 2]
    status, exc = fails()
    assert status == "err" and isinstance(exc, KeyError)
    with pytest.raises(KeyError, match="no such key"):
        answer(fails())
    assert answer(pickled()) == (object, 1)
    assert answer(ok(("ok", 5))) == ["ok", 5]  # a value shaped like a guard reply is still a value
    assert answer(guard(lambda: {"a": 1})()) == {"a": 1}


def test_request_sends_bad_values_as_their_repr():
    assert msgspec.msgpack.decode(request(8, np.int32(2), None, object)) == [8, 2, None, repr(object)]
