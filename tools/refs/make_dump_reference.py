#!/usr/bin/python3
"""Reference .npy/.npz files for posenc's tensor dump reader (tests/verify/tensor_dump_test.cpp).

Writes, with numpy itself (np.save, np.lib.format.write_array, np.savez, np.savez_compressed),
one small file per case into OUT_DIR, and OUT_DIR/reference.json describing them:
  - every dtype the reader takes: <f8 <f4 <f2 <i8 <i4 <i2 |i1 |u1 |b1, with edge values
    (inf, nan, -0.0, subnormals, the integer limits, +-2^53 for int64);
  - the big-endian forms >f8 >f4 >f2 >i8 >i4 >i2 (arr.astype('>f4') ...);
  - Fortran-order arrays (np.asfortranarray), a 2.0 and a 3.0 header, 0-d arrays, an empty array;
  - an .npz of stored members (np.savez) and one of deflated members (np.savez_compressed).
For each array reference.json has its name, descr, shape, fortran_order and its values in C order
widened to float64 by numpy (astype(np.float64)), non-finite values as the strings "nan", "inf",
"-inf"; for each .npy file its sha256; for each .npz the sha256 of every member's uncompressed bytes
(zip time stamps make the archive bytes differ from run to run; the members do not).
"canonical" marks the .npy files that are version 1.0, little-endian and C order: those posenc's
encode_npy must reproduce byte for byte.

Usage: /usr/bin/python3 tools/refs/make_dump_reference.py OUT_DIR
(/usr/bin/python3 is Debian's interpreter, which has numpy; the committed files were written with
the numpy version recorded in reference.json.)
"""
import hashlib
import json
import math
import os
import platform
import sys
import zipfile

import numpy as np


def value_list(arr):
    out = []
    for v in np.ascontiguousarray(arr).ravel(order="C").astype(np.float64):
        v = float(v)
        if math.isnan(v):
            out.append("nan")
        elif math.isinf(v):
            out.append("inf" if v > 0 else "-inf")
        else:
            out.append(v)
    return out


def describe(name, arr):
    return {
        "name": name,
        "descr": np.lib.format.dtype_to_descr(arr.dtype),
        "shape": list(arr.shape),
        "fortran_order": bool(arr.flags.f_contiguous and not arr.flags.c_contiguous),
        "values": value_list(arr),
    }


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def cases():
    f64 = np.array([[0.1, -2.5, 1e300], [5e-324, -0.0, np.inf], [-np.inf, np.nan, 2.0**-1022]], dtype=np.float64)
    f32 = np.array([[1.0, -0.5, 3.4028234663852886e38, 1.401298464324817e-45],
                    [np.float32(0.1), -0.0, np.inf, np.nan]], dtype=np.float32)
    f16 = np.array([[65504.0, -65504.0, 2.0**-24, 2.0**-14, np.inf],
                    [np.nan, -0.0, 0.1, 1.0 / 3.0, -2.0]], dtype=np.float16)
    i64 = np.array([2**53, -(2**53), 0, -1, 123456789012], dtype=np.int64)
    i32 = np.array([[-(2**31), 2**31 - 1], [0, -7]], dtype=np.int32)
    i16 = np.array([-32768, 32767, 5], dtype=np.int16)
    i8 = np.array([-128, 127, 0, 1], dtype=np.int8)
    u8 = np.array([0, 255, 17], dtype=np.uint8)
    b1 = np.array([[True, False], [True, True]], dtype=np.bool_)
    fortran = np.asfortranarray(np.arange(24, dtype=np.float32).reshape(2, 3, 4) * np.float32(0.25) - 1)
    fortran_i32 = np.asfortranarray(np.array([[1, 2], [3, 4], [5, 6]], dtype=np.int32))
    single = [
        ("f64.npy", "f64", f64, None),
        ("f32.npy", "f32", f32, None),
        ("f16.npy", "f16", f16, None),
        ("i64.npy", "i64", i64, None),
        ("i32.npy", "i32", i32, None),
        ("i16.npy", "i16", i16, None),
        ("i8.npy", "i8", i8, None),
        ("u8.npy", "u8", u8, None),
        ("bool.npy", "bool", b1, None),
        ("f64_be.npy", "f64_be", f64[:2, :2].astype(">f8"), None),
        ("f32_be.npy", "f32_be", f32[1].astype(">f4"), None),
        ("f16_be.npy", "f16_be", f16[:, :2].astype(">f2"), None),
        ("i64_be.npy", "i64_be", i64.astype(">i8"), None),
        ("i32_be.npy", "i32_be", i32.astype(">i4"), None),
        ("i16_be.npy", "i16_be", i16.astype(">i2"), None),
        ("f32_fortran.npy", "f32_fortran", fortran, None),
        ("i32_fortran.npy", "i32_fortran", fortran_i32, None),
        ("f32_v2.npy", "f32_v2", f32, (2, 0)),
        ("f16_v3.npy", "f16_v3", f16, (3, 0)),
        ("scalar_f64.npy", "scalar_f64", np.array(3.25), None),
        ("scalar_i64.npy", "scalar_i64", np.array(-42, dtype=np.int64), None),
        ("empty_f32.npy", "empty_f32", np.zeros((0, 3), dtype=np.float32), None),
    ]
    rng = np.random.default_rng(18)
    q = rng.standard_normal((3, 2, 4)).astype(np.float32)
    q_rope = rng.standard_normal((3, 2, 4)).astype(np.float32)
    position_ids = np.array([0, 1, 2], dtype=np.int64)
    k = rng.standard_normal((3, 1, 4)).astype(np.float16)
    archives = [
        ("dump.npz", False, [("q", q), ("q_rope", q_rope), ("position_ids", position_ids)]),
        ("dump_compressed.npz", True,
         [("q", q), ("q_rope", q_rope), ("position_ids", position_ids), ("k", k), ("k_be", k.astype(">f2")),
          ("cos", np.asfortranarray(np.cos(q[:, 0, :]).astype(np.float64)))]),
    ]
    return single, archives


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    single, archives = cases()
    files = []
    for fname, name, arr, version in single:
        path = os.path.join(out_dir, fname)
        if version is None:
            np.save(path, arr)
        else:
            with open(path, "wb") as f:
                np.lib.format.write_array(f, arr, version=version)
        data = open(path, "rb").read()
        d = describe(name, arr)
        canonical = version is None and not d["fortran_order"] and not d["descr"].startswith(">")
        files.append({"file": fname, "kind": "npy", "sha256": sha256(data), "canonical": canonical, "arrays": [d]})
    for fname, compressed, members in archives:
        path = os.path.join(out_dir, fname)
        (np.savez_compressed if compressed else np.savez)(path, **dict(members))
        with zipfile.ZipFile(path) as z:
            member_hashes = [{"member": i.filename, "compress_type": i.compress_type, "sha256": sha256(z.read(i))}
                             for i in z.infolist()]
        files.append({"file": fname, "kind": "npz", "members": member_hashes,
                      "arrays": [describe(n, a) for n, a in members]})
    ref = {
        "generator": "tools/refs/make_dump_reference.py",
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "files": files,
    }
    # One line per file: small, and a diff names the file that changed.
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        f.write("{\n")
        for key in ("generator", "numpy_version", "python_version"):
            f.write(" %s: %s,\n" % (json.dumps(key), json.dumps(ref[key])))
        f.write(' "files": [\n  ')
        f.write(",\n  ".join(json.dumps(e, sort_keys=True, separators=(",", ":")) for e in files))
        f.write("\n ]\n}\n")


if __name__ == "__main__":
    main()
