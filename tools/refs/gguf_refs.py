#!/usr/bin/python3
"""Reference data for posenc's GGUF reader, dequantizer and quantizer, from gguf-py.

Run with the system Python (it has numpy) and llama.cpp's gguf-py on the path:

  PYTHONPATH=/work/refs/llama.cpp-src/gguf-py /usr/bin/python3 tools/refs/gguf_refs.py \
      --shared /work/shared --out tests/model/formats/data/gguf_reference.json

gguf-py is llama.cpp's own Python GGUF package (gguf/gguf_reader.py reads the
files, gguf/quants.py (de)quantizes; its Q8_0 quantizer is documented as
bit-exact with ggml's quantize_row_q8_0_ref). Recorded per file: the header,
every metadata key with its type and value (arrays longer than 16: count,
first and last 3 elements and an FNV-1a-64 hash of the elements' bytes as
stored in the file: for strings uint64 length + bytes), and every tensor's
name, ggml type, extents (ne, innermost first), offset relative to the data
section, byte size and a checksum of its values dequantized to float32 by
gguf.quants.dequantize (sum and sum of squares in float64, FNV-1a-64 of the
little-endian float32 bytes, values at fixed indices).

Quantization references: the first 4096 float32 values of stories260K.gguf's
token_embd.weight (the test reads them from the file) and a 512-value edge set
(stored here as float32 bit patterns: zero blocks, f16-subnormal scales, exact
.5 ties, scales that overflow binary16, negative maxima, binary16 rounding
midpoints), each quantized by gguf.quants.quantize to Q8_0, Q4_0, F16 and BF16
(hash + some blocks in hex), and the Q8_0 / Q4_0 bytes dequantized again.
"""
import argparse
import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

import gguf
from gguf import GGUFReader, GGUFValueType, GGMLQuantizationType
from gguf.quants import dequantize, quantize

LLAMA_CPP_COMMIT = "de3ff81"  # the llama.cpp source bundled in node-llama-cpp 3.22.1
FILES = {
    "stories260K.gguf": "models/stories260K/stories260K.gguf",
    "TinyStories-656K-Q8_0.gguf": "models/TinyStories-656K-gguf/TinyStories-656K-Q8_0.gguf",
}
BIG_ARRAY = 16  # arrays longer than this are summarized


def fnv1a64(data: bytes) -> str:
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def gguf_py_version() -> str:
    pyproject = Path(gguf.__file__).resolve().parent.parent / "pyproject.toml"
    for line in pyproject.read_text().splitlines():
        if line.startswith("version"):
            return line.split("=", 1)[1].strip().strip('"')
    return "unknown"


def llama_cpp_commit() -> str:
    src = Path(gguf.__file__).resolve().parent.parent.parent
    try:
        out = subprocess.run(["git", "-C", str(src), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                             text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def scalar_json(vtype: GGUFValueType, part: np.ndarray):
    if vtype == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    if vtype == GGUFValueType.BOOL:
        return bool(part[0])
    if vtype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        return float(part[0])
    return int(part[0])


def metadata_entry(key: str, field) -> dict:
    main = field.types[0]
    entry = {"key": key, "type": main.name.lower()}
    if main != GGUFValueType.ARRAY:
        entry["value"] = scalar_json(main, field.parts[field.data[0]])
        return entry
    if len(field.types) != 2:
        raise SystemExit(f"{key}: arrays of arrays are not expected in the reference files")
    et = field.types[1]
    entry["element_type"] = et.name.lower()
    parts = [field.parts[i] for i in field.data]
    values = [scalar_json(et, p) for p in parts]
    entry["count"] = len(values)
    if et == GGUFValueType.STRING:
        raw = b"".join(struct.pack("<Q", len(bytes(p))) + bytes(p) for p in parts)
    else:
        raw = b"".join(p.tobytes() for p in parts)
    entry["fnv1a64"] = fnv1a64(raw)
    if len(values) <= BIG_ARRAY:
        entry["values"] = values
    else:
        entry["first"] = values[:3]
        entry["last"] = values[-3:]
    return entry


def sample_indices(n: int) -> list:
    return sorted({0, 1, 31, 32, n // 3, n // 2, (n * 7) // 9, n - 1} & set(range(n)))


def tensor_entry(t, data_offset: int) -> dict:
    x = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
    assert x.size == int(t.n_elements), t.name
    x64 = x.astype(np.float64)
    return {
        "name": t.name,
        "type": int(t.tensor_type),
        "type_name": t.tensor_type.name,
        "ne": [int(d) for d in t.shape],
        "offset": int(t.data_offset) - data_offset,
        "n_bytes": int(t.n_bytes),
        "n_elements": int(t.n_elements),
        "sum": float(np.sum(x64)),
        "sum_sq": float(np.sum(x64 * x64)),
        "fnv1a64_f32": fnv1a64(x.astype("<f4").tobytes()),
        "samples": [[i, float(x[i])] for i in sample_indices(x.size)],
    }


def file_entry(shared: Path, rel: str) -> dict:
    path = shared / rel
    r = GGUFReader(str(path))
    keys = [k for k in r.fields if not k.startswith("GGUF.")]
    return {
        "path": rel,
        "size": path.stat().st_size,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "version": int(r.fields["GGUF.version"].parts[0][0]),
        "tensor_count": int(r.fields["GGUF.tensor_count"].parts[0][0]),
        "kv_count": int(r.fields["GGUF.kv_count"].parts[0][0]),
        "alignment": int(r.alignment),
        "data_offset": int(r.data_offset),
        "metadata": [metadata_entry(k, r.fields[k]) for k in keys],
        "tensors": [tensor_entry(t, int(r.data_offset)) for t in r.tensors],
    }


def f16_midpoints() -> list:
    """float32 values at and next to the rounding midpoints of binary16 (normal and subnormal)."""
    out = []
    for h in [0x0000, 0x0001, 0x0002, 0x0003, 0x01FF, 0x03FE, 0x03FF, 0x0400, 0x0401, 0x3BFF, 0x3C00, 0x3C01,
              0x5A5A, 0x7BFE, 0x7BFF]:
        lo = np.array([h], dtype=np.uint16).view(np.float16).astype(np.float32)[0]
        hi = np.float32(65536.0) if h == 0x7BFF else np.array([h + 1], dtype=np.uint16).view(np.float16).astype(
            np.float32)[0]  # 65536: where the next binary16 would be
        mid = np.float32((np.float64(lo) + np.float64(hi)) / 2)  # exact: the midpoint has <= 12 significant bits
        bits = int(np.array([mid], dtype=np.float32).view(np.uint32)[0])
        out += [bits - 1, bits, bits + 1]
    return out


def edge_inputs() -> np.ndarray:
    """512 float32 values (16 blocks of 32) aimed at the corners of Q8_0, Q4_0, F16 and BF16."""
    blocks = []
    z = np.zeros(32, dtype=np.float32)
    blocks.append(z.copy())                                         # all zeros
    b = z.copy()
    b[5] = np.float32(-0.0)
    b[9] = np.float32(0.0)
    blocks.append(b)                                                # signed zeros
    k = np.arange(32, dtype=np.float32)
    blocks.append(((k - 16) * np.float32(1e-6)).astype(np.float32))  # d is a binary16 subnormal
    blocks.append(((k - 16) * np.float32(3e-10)).astype(np.float32))  # d underflows binary16 to 0
    t = (k - 15.5).astype(np.float32)                               # exact .5 ties, amax 127 -> d == 1
    t[0] = np.float32(-127.0)
    blocks.append(t)
    t2 = (k * 2 - 31).astype(np.float32) / np.float32(2)          # ties again, positive max
    t2[31] = np.float32(127.0)
    blocks.append(t2.astype(np.float32))
    blocks.append(((k - 16) * np.float32(6e5)).astype(np.float32))   # d = amax/127 > 65504: binary16 inf
    n = np.linspace(-2.9, 2.9, 32).astype(np.float32)
    n[7] = np.float32(-3.0)                                         # Q4_0: negative maximum
    blocks.append(n)
    m = np.linspace(-1, 1, 32).astype(np.float32)
    m[3], m[20] = np.float32(2.0), np.float32(-2.0)                 # Q4_0: |max| twice, first one wins
    blocks.append(m)
    mids = np.array(f16_midpoints(), dtype=np.uint32).view(np.float32)
    pad = (-len(mids)) % 32
    mids = np.concatenate([mids, np.full(pad, np.float32(0.25))])
    blocks += [mids[i:i + 32] for i in range(0, len(mids), 32)]
    rng = np.random.default_rng(20240601)
    while len(blocks) < 16:
        blocks.append(rng.standard_normal(32).astype(np.float32) * np.float32(10.0 ** rng.integers(-3, 4)))
    x = np.concatenate(blocks).astype(np.float32)
    assert x.size == 512 and np.all(np.isfinite(x))
    return x


def quant_entry(x: np.ndarray, full_blocks: list) -> dict:
    out = {}
    for qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.F16,
                  GGMLQuantizationType.BF16):
        with np.errstate(over="ignore", invalid="ignore"):
            q = np.ascontiguousarray(quantize(x, qtype)).view(np.uint8).reshape(-1)
        block_bytes = gguf.GGML_QUANT_SIZES[qtype][1] * (32 if qtype in (GGMLQuantizationType.F16,
                                                                          GGMLQuantizationType.BF16) else 1)
        e = {"n_bytes": int(q.size), "fnv1a64": fnv1a64(q.tobytes()),
             "blocks": {str(i): q[i * block_bytes:(i + 1) * block_bytes].tobytes().hex()
                        for i in full_blocks if (i + 1) * block_bytes <= q.size}}
        if qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0):
            with np.errstate(over="ignore", invalid="ignore"):
                y = dequantize(q.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1]), qtype).astype(np.float32)
            e["dequantized_fnv1a64_f32"] = fnv1a64(y.astype("<f4").reshape(-1).tobytes())
        out[qtype.name.lower()] = e
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shared", default=os.environ.get("POSENC_SHARED_DIR", "/work/shared"))
    ap.add_argument("--out", default="tests/model/formats/data/gguf_reference.json")
    args = ap.parse_args()
    shared = Path(args.shared)

    files = {name: file_entry(shared, rel) for name, rel in FILES.items()}

    r = GGUFReader(str(shared / FILES["stories260K.gguf"]))
    emb = next(t for t in r.tensors if t.name == "token_embd.weight")
    src = dequantize(emb.data, emb.tensor_type).astype(np.float32).reshape(-1)[:4096]
    edge = edge_inputs()
    quant = {
        "token_embd": {
            "source": "stories260K.gguf token_embd.weight, the first 4096 float32 values (ggml order)",
            "n_values": 4096,
            "input_fnv1a64_f32": fnv1a64(src.astype("<f4").tobytes()),
            **quant_entry(src, [0, 1, 2, 63, 127]),
        },
        "edge": {
            "source": "edge_inputs() in tools/refs/gguf_refs.py",
            "n_values": int(edge.size),
            "input_bits": [f"{int(b):08x}" for b in edge.view(np.uint32)],
            **quant_entry(edge, list(range(16))),
        },
    }

    out = {
        "generator": {
            "script": "tools/refs/gguf_refs.py",
            "gguf_py_version": gguf_py_version(),
            "llama_cpp_commit": LLAMA_CPP_COMMIT,
            "llama_cpp_checkout": llama_cpp_commit(),
            "numpy_version": np.__version__,
            "python": sys.version.split()[0],
            "hash": "FNV-1a 64 (offset 0xcbf29ce484222325, prime 0x100000001b3) over the bytes, hex",
        },
        "files": files,
        "quantization": quant,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, allow_nan=False) + "\n")


if __name__ == "__main__":
    main()
