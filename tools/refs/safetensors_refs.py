#!/usr/bin/python3
"""Reference values for posenc's safetensors reader (tests/model/formats/safetensors_test.cpp).

An independent reader: the 8-byte header length and the JSON header are read with the
standard library (struct, json), the tensors with numpy. For every tensor it records the
name, dtype, shape, data_offsets and float32 checksums; for the F16 and BF16 copies the test
writes, it records what numpy makes of the same values:
  f16:  numpy's float32 -> float16 conversion (round to nearest even), as bits and back as float32;
  bf16: float32 -> bfloat16 rounded to nearest even on the bit patterns (numpy has no bfloat16),
        and bfloat16 -> float32 as the bits shifted left by 16.
The model's weights have bfloat16 precision (the low 16 bits of every float32 are zero),
so converting them rounds little; "perturbed" records the same conversions of every weight
(tensors in name order, concatenated) times float32(1.2345678) in float32, which uses the
full mantissa. It also records numpy's float16 -> float32 of all 65536 half bit patterns (as checksums) and
numpy's float32 -> float16 of edge values (overflow, subnormals, ties, inf, nan).

Integer checksums are exact: bits_sum = sum of the bit patterns, bits_weighted = sum of
(i + 1) * bits[i] modulo 2^64 (position-sensitive).

Usage: /usr/bin/python3 tools/refs/safetensors_refs.py MODEL.safetensors OUT.json
(/usr/bin/python3 is Debian's interpreter, which has numpy.)
"""
import hashlib
import json
import platform
import struct
import sys

import numpy as np

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None}


def bit_checksums(bits):
    u = bits.astype(np.uint64)
    weights = np.arange(1, u.size + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return {"bits_sum": int(u.sum(dtype=np.uint64)), "bits_weighted": int((u * weights).sum(dtype=np.uint64))}


def sample_indices(values):
    n = values.size
    idx = {0, min(1, n - 1), n // 2, n - 1, int(np.argmax(np.abs(values))), int(np.argmin(np.abs(values)))}
    return sorted(i for i in idx if 0 <= i < n)


def value_checksums(values, bits):
    v64 = values.astype(np.float64)
    out = {
        "sum": float(v64.sum()),
        "sum_sq": float((v64 * v64).sum()),
        "sum_abs": float(np.abs(v64).sum()),
    }
    out.update(bit_checksums(bits))
    out["samples"] = [[i, int(bits[i]), float(values[i])] for i in sample_indices(values)]
    return out


def f32_to_bf16_bits(values):
    """float32 -> bfloat16 bits, round to nearest even; NaN kept NaN (quiet bit set)."""
    u = values.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    rounded[nan] = ((u[nan] >> 16) | 0x0040).astype(np.uint16)
    return rounded


def bf16_bits_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def main():
    path, out_path = sys.argv[1], sys.argv[2]
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n].decode("utf-8"))
    data = raw[8 + n :]
    metadata = header.pop("__metadata__", {})
    tensors = []
    for name in sorted(header):
        e = header[name]
        begin, end = e["data_offsets"]
        if e["dtype"] != "F32":
            raise SystemExit(f"{name}: this reference expects F32 tensors (got {e['dtype']})")
        values = np.frombuffer(data[begin:end], dtype="<f4").copy()
        assert values.size == int(np.prod(e["shape"], dtype=np.int64))
        f16 = values.astype(np.float16)
        bf16 = f32_to_bf16_bits(values)
        tensors.append(
            {
                "name": name,
                "dtype": e["dtype"],
                "shape": e["shape"],
                "data_offsets": [begin, end],
                "f32": value_checksums(values, values.view(np.uint32)),
                "f16": value_checksums(f16.astype(np.float32), f16.view(np.uint16)),
                "bf16": value_checksums(bf16_bits_to_f32(bf16), bf16),
            }
        )

    all_halves = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    as_f32 = all_halves.view(np.float16).astype(np.float32)
    finite = ~np.isnan(as_f32)
    edge = np.array(
        [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.99, 65520.0, 1e6, -1e6, 2.0**-14, 2.0**-24, 2.0**-25,
         np.nextafter(np.float32(2.0**-25), np.float32(1)), 1.5 * 2.0**-24, 2.5 * 2.0**-24, 2.0**-26, 1e-8,
         1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 0.1, 1.0 / 3.0, 6.1e-5, np.inf, -np.inf],
        dtype=np.float32,
    )
    with np.errstate(over="ignore"):
        edge_f16 = edge.astype(np.float16).view(np.uint16)
    everything = np.concatenate([np.frombuffer(data[t["data_offsets"][0] : t["data_offsets"][1]], dtype="<f4")
                                 for t in tensors])
    perturbed = everything * np.float32(1.2345678)
    assert perturbed.dtype == np.float32
    perturbed_f16 = perturbed.astype(np.float16)
    ref = {
        "generator": "tools/refs/safetensors_refs.py",
        "versions": {"python": platform.python_version(), "numpy": np.__version__},
        "file": {
            "name": "models/TinyStories-656K/model.safetensors",
            "size": len(raw),
            "sha256": hashlib.sha256(raw).hexdigest(),
            "header_length": n,
        },
        "metadata": metadata,
        "tensors": tensors,
        "perturbed": {
            "factor": float(np.float32(1.2345678)),
            "count": int(perturbed.size),
            "f32": bit_checksums(perturbed.view(np.uint32)),
            "f16": value_checksums(perturbed_f16.astype(np.float32), perturbed_f16.view(np.uint16)),
            "bf16": value_checksums(bf16_bits_to_f32(f32_to_bf16_bits(perturbed)), f32_to_bf16_bits(perturbed)),
        },
        "f16_to_f32_all_patterns": {
            "non_nan": int(finite.sum()),
            **bit_checksums(np.where(finite, as_f32.view(np.uint32), 0)),
        },
        # [float32 bits, numpy's float16 bits] (bits: JSON has no inf)
        "f32_to_f16_edges": [[int(x), int(b)] for x, b in zip(edge.view(np.uint32), edge_f16)],
    }
    with open(out_path, "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
