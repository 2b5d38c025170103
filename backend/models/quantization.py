"""Quantized checkpoints, read as they are stored, and quantization at load time.

Every reader here turns a checkpoint's own integers into `kernels.QuantizedWeight`s (one
format: w = scale * q + min per group along the input), never into float weights:

- GGUF files (llama.cpp), through the `gguf` package's reader: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
  Q4_K and Q6_K blocks (the types of llama.cpp's Q4_0, Q4_1, Q8_0 and Q4_K_M files, with the
  Q5_0/Q5_1 it puts where rows are no multiple of 256), F32/F16/BF16 tensors as floats. llama.cpp stores the q and k projections of Llama models with their
  rows permuted for its rotary layout; `GgufCheckpoint` undoes it on the integers' rows.
- Hugging Face `quantization_config`: AWQ (GEMM packing), GPTQ (with or without act-order)
  and compressed-tensors pack-quantized W4A16/W8A16 (`read_packed_linear`).
- `quantize_weight`: int8 per output channel or int4 per group of a float checkpoint, the
  engine parameter `quantization`.

Anything else is refused at load (`QuantizationError`), naming the method or block type and
what is supported. Each reader's numbers are the ones the format defines, to the bit: the
tests compare `QuantizedWeight.dequantize()` with gguf-py's own de-quantization and with
transformers running the de-quantized model.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator

import numpy as np
import torch

from backend.config import QUANTIZATION_MODES
from kernels import QuantizedWeight, quantize

GGUF_BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K")
GGUF_FLOAT_TYPES = ("F32", "F16", "BF16")
PACKED_METHODS = ("awq", "gptq", "compressed-tensors")


class QuantizationError(ValueError):
    pass


def quantize_weight(weight: torch.Tensor, mode: str, group_size: int) -> QuantizedWeight:
    """The engine's `quantization` at load: int8 with one scale per output channel, int4 with
    a scale and a min per `group_size` inputs."""
    if mode == "int8":
        return quantize(weight, 8, None)
    if mode == "int4":
        return quantize(weight, 4, group_size)
    raise QuantizationError(f"quantization={mode!r}, expected one of {QUANTIZATION_MODES}")


# --------------------------------------------------------------------------------------
# GGUF


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, as float32 (exact)."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16*c] bytes -> [n, c, 32]: per 16 bytes, the low nibbles then the high ones."""
    qs = qs.reshape(qs.shape[0], -1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & 0x0F).reshape(qs.shape[0], -1, 32)


def _decode_blocks(type_name: str, blocks: np.ndarray):
    """One GGUF block type's bytes [num_blocks, block_bytes] -> (q [num_blocks, n], scales
    [num_blocks, groups], mins or None, bits, group)."""
    if type_name == "Q8_0":  # d f16, 32 x int8
        return blocks[:, 2:].copy().view(np.int8), _f16(blocks, 0)[:, None], None, 8, 32
    if type_name == "Q4_0":  # d f16, 16 bytes of nibbles; w = d * (q - 8)
        d = _f16(blocks, 0)[:, None]
        return _nibbles(blocks[:, 2:]).reshape(len(blocks), 32), d, -8.0 * d, 4, 32
    if type_name == "Q4_1":  # d f16, m f16, 16 bytes of nibbles; w = d * q + m
        return _nibbles(blocks[:, 4:]).reshape(len(blocks), 32), _f16(blocks, 0)[:, None], _f16(blocks, 2)[:, None], 4, 32
    if type_name in ("Q5_0", "Q5_1"):
        # d f16 (Q5_1: and m f16), 32 fifth bits (a little-endian uint32), 16 bytes of nibbles;
        # Q5_0: w = d * (q - 16), Q5_1: w = d * q + m. Held as 8-bit integers.
        at = 2 if type_name == "Q5_0" else 4
        high = blocks[:, at:at + 4].copy().view(np.uint32)[:, :1] >> np.arange(32, dtype=np.uint32) & 1
        q = (_nibbles(blocks[:, at + 4:]).reshape(len(blocks), 32) | (high.astype(np.uint8) << 4)).astype(np.int16)
        d = _f16(blocks, 0)[:, None]
        if type_name == "Q5_0":
            return (q - 16).astype(np.int8), d, None, 8, 32
        return q.astype(np.int8), d, _f16(blocks, 2)[:, None], 8, 32
    if type_name == "Q4_K":
        # 256 weights: d f16, dmin f16, 12 bytes of eight 6-bit scales and mins, 128 bytes of
        # nibbles (per 32 bytes: one sub-block's 32 in the low nibbles, the next one's in the high).
        d, dmin = _f16(blocks, 0)[:, None], _f16(blocks, 2)[:, None]
        packed = blocks[:, 4:16].reshape(-1, 3, 4)
        low, high, rest = packed[:, 0], packed[:, 1], packed[:, 2]
        sc = np.concatenate([low & 0x3F, (rest & 0x0F) | ((low >> 2) & 0x30)], axis=1).astype(np.float32)
        mn = np.concatenate([high & 0x3F, (rest >> 4) | ((high >> 2) & 0x30)], axis=1).astype(np.float32)
        q = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        return (q & 0x0F).reshape(len(blocks), 256), d * sc, -(dmin * mn), 4, 32
    if type_name == "Q6_K":
        # 256 weights: 128 bytes of low nibbles, 64 of high 2-bit pairs, sixteen int8 scales
        # (one per 16 weights), d f16; w = d * scale * (q - 32).
        ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        ql = (ql & 0x0F).reshape(len(blocks), 2, 128)
        qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        qh = (qh & 0x03).reshape(len(blocks), 2, 128)
        q = ((ql | (qh << 4)).astype(np.int16) - 32).astype(np.int8).reshape(len(blocks), 256)
        scales = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
        return q, _f16(blocks, 208)[:, None] * scales, None, 8, 16
    raise AssertionError(type_name)


def gguf_quantized(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """A GGUF tensor's blocks (`raw`: bytes [rows, row_bytes]) as a QuantizedWeight [out, in]."""
    out, k = shape
    blocks = np.ascontiguousarray(raw).reshape(out * (k // _block_elems(type_name)), -1)
    q, scales, mins, bits, group = _decode_blocks(type_name, blocks)
    q = torch.from_numpy(q.astype(np.int8, copy=False).reshape(out, k).copy())
    scales = torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32).reshape(out, k // group))
    mins = None if mins is None else torch.from_numpy(np.ascontiguousarray(mins, dtype=np.float32).reshape(out, k // group))
    return QuantizedWeight(q, scales, mins, bits, group)


def _block_elems(type_name: str) -> int:
    return 256 if type_name.endswith("_K") else 32


# GGUF tensor names (llama.cpp's, for the Llama-family architectures) -> Hugging Face's.
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# The GGUF architectures served, and whether llama.cpp permuted their q/k rows.
GGUF_ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False}


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    return None


def _unpermute_rows(rows: int, num_heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's rotary permutation of a q or k projection
    (per head, its two halves interleaved)."""
    head_dim = rows // num_heads
    permuted = torch.arange(rows).view(num_heads, 2, head_dim // 2).transpose(1, 2).reshape(-1)
    return torch.argsort(permuted)


def _gguf_reader(path: str):
    """gguf's reader over a plain array view of the file's memory map: the reader's own
    np.memmap makes each of the ~250k small reads of a vocabulary's metadata go through
    memmap's Python hooks (SmolLM2's file: 3.4 s instead of 7-14 s)."""
    import gguf  # the file format's own reader (pinned in requirements.txt)

    class Reader(gguf.GGUFReader):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value):
            self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return Reader(path)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, mtime: float):
    del mtime  # part of the cache key only: a rewritten file is read again
    return _gguf_reader(path)


# GGUF metadata (under "<architecture>.") -> Hugging Face config fields.
_GGUF_CONFIG_KEYS = {
    "block_count": "num_hidden_layers", "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "rope.freq_base": "rope_theta", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim", "vocab_size": "vocab_size",
}


class GgufCheckpoint:
    """A .gguf file: its model config (from its metadata) and its tensors under Hugging Face
    names, quantized ones as QuantizedWeight."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.reader = _open_gguf(os.path.abspath(path), os.path.getmtime(path))
        except (OSError, ValueError) as exc:
            raise QuantizationError(f"cannot read the GGUF file {path}: {exc}") from None
        arch_field = self.reader.get_field("general.architecture")
        self.architecture = arch_field.contents() if arch_field is not None else "?"
        if self.architecture not in GGUF_ARCHITECTURES:
            raise QuantizationError(
                f"GGUF architecture {self.architecture!r} in {path} is not served; "
                f"supported: {', '.join(GGUF_ARCHITECTURES)}")

    def _field(self, key: str):
        field = self.reader.get_field(key)
        return None if field is None else field.contents()

    def config_fields(self) -> dict:
        """The Hugging Face config fields (model_type and the transformers config's keys)."""
        arch = self.architecture
        fields: dict = {"model_type": arch}
        for key, name in _GGUF_CONFIG_KEYS.items():
            value = self._field(f"{arch}.{key}")
            if value is not None:
                fields[name] = value
        if "vocab_size" not in fields:
            fields["vocab_size"] = len(self.reader.get_field("tokenizer.ggml.tokens").data)
        scaling = self._field(f"{arch}.rope.scaling.type")
        if scaling not in (None, "none"):
            if scaling != "linear":
                raise QuantizationError(f"GGUF {self.path}: rope scaling {scaling!r}; supported: none, linear")
            fields["rope_scaling"] = {"rope_type": "linear", "factor": self._field(f"{arch}.rope.scaling.factor")}
        names = {t.name for t in self.reader.tensors}
        if "rope_freqs.weight" in names:
            raise QuantizationError(f"GGUF {self.path} carries rope_freqs (llama3-style rope factors); "
                                    "supported: plain and linear rope")
        fields["tie_word_embeddings"] = "output.weight" not in names
        for token in ("bos", "eos"):
            value = self._field(f"tokenizer.ggml.{token}_token_id")
            if value is not None:
                fields[f"{token}_token_id"] = value
        return fields

    def tensors(self, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        permuted = GGUF_ARCHITECTURES[self.architecture]
        for tensor in self.reader.tensors:
            name = _hf_name(tensor.name)
            if name is None:
                yield tensor.name, None  # the loader reports it as unexpected
                continue
            type_name = tensor.tensor_type.name
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists the fastest dim first
            if type_name in GGUF_FLOAT_TYPES:
                data = np.asarray(tensor.data)
                value = (torch.from_numpy(data.view(np.uint16).astype(np.int32) << 16).view(torch.float32)
                         if type_name == "BF16" else torch.from_numpy(data.astype(np.float32)))
                value = value.reshape(shape)
            elif type_name in GGUF_BLOCK_TYPES:
                if len(shape) != 2:
                    raise QuantizationError(f"GGUF tensor {tensor.name} is {type_name} with shape {shape}; "
                                            "quantized tensors must be matrices")
                value = gguf_quantized(type_name, np.asarray(tensor.data), shape)
            else:
                raise QuantizationError(
                    f"GGUF tensor {tensor.name} in {self.path} has block type {type_name}; "
                    f"supported: {', '.join(GGUF_BLOCK_TYPES + GGUF_FLOAT_TYPES)}")
            if permuted and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
                heads = num_heads if ".q_proj." in name else num_kv_heads
                order = _unpermute_rows(shape[0], heads)
                value = value.select_rows(order) if isinstance(value, QuantizedWeight) else value[order]
            yield name, value


# --------------------------------------------------------------------------------------
# Hugging Face quantization_config: AWQ, GPTQ, compressed-tensors


def _unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words holding 32 // bits values each (lowest bits first, or in `order`) ->
    their values along `dim`, as int16."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., per_word]
    if order is not None:
        # AWQ's word holds the values of columns [0, 2, 4, 6, 1, 3, 5, 7] in its 8 nibbles.
        values = values[..., list(np.argsort(order))]
    values = values.to(torch.int16)
    if dim == -1 or dim == packed.dim() - 1:
        return values.reshape(*packed.shape[:-1], packed.shape[-1] * per_word)
    # Packed along dim 0: word i holds rows i * per_word ... i * per_word + per_word - 1.
    return values.permute(0, 2, 1).reshape(packed.shape[0] * per_word, packed.shape[1])


_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def check_packed_config(qcfg: dict, where: str) -> tuple[str, int, int]:
    """(method, bits, group_size) of a quantization_config this engine serves, else a
    QuantizationError naming what it is and what is supported."""
    method = str(qcfg.get("quant_method", "?"))

    def refuse(why: str) -> QuantizationError:
        return QuantizationError(f"unsupported quantization_config (quant_method={method!r}) in {where}: {why}")

    if method not in PACKED_METHODS:
        raise refuse(f"supported methods: {', '.join(PACKED_METHODS)}, or GGUF files")
    if method == "compressed-tensors":
        fmt = qcfg.get("format")
        groups = qcfg.get("config_groups") or {}
        if fmt != "pack-quantized" or len(groups) != 1:
            raise refuse(f"format {fmt!r} with {len(groups)} config group(s); supported: one pack-quantized group (W4A16, W8A16)")
        group = next(iter(groups.values()))
        weights, acts = group.get("weights") or {}, group.get("input_activations")
        if acts:
            raise refuse("quantized activations; supported: weight-only W4A16 and W8A16")
        bits, strategy = int(weights.get("num_bits", 0)), weights.get("strategy")
        if bits not in (4, 8) or weights.get("type", "int") != "int" or strategy not in ("group", "channel"):
            raise refuse(f"weights {bits}-bit {weights.get('type')} by {strategy}; supported: int 4 or 8 bits by group or channel")
        if weights.get("actorder"):
            raise refuse("actorder; supported: groups in input order")
        return method, bits, int(weights.get("group_size") or 0) if strategy == "group" else 0
    bits = int(qcfg.get("bits", qcfg.get("w_bit", 0)))
    group = int(qcfg.get("group_size", qcfg.get("q_group_size", 0)))
    if bits != 4:
        raise refuse(f"bits={bits}; supported: 4")
    if method == "awq" and str(qcfg.get("version", "gemm")).lower() != "gemm":
        raise refuse(f"version={qcfg.get('version')!r}; supported: gemm")
    if method == "gptq" and qcfg.get("checkpoint_format", "gptq") not in ("gptq",):
        raise refuse(f"checkpoint_format={qcfg.get('checkpoint_format')!r}; supported: gptq")
    if group <= 0:
        raise refuse(f"group_size={group}; supported: a positive group size")
    return method, bits, group


# The tensors each packed method stores for one linear layer, by suffix.
PACKED_SUFFIXES = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point"),
}


def read_packed_linear(method: str, bits: int, group_size: int, parts: dict[str, torch.Tensor], qcfg: dict,
                       name: str) -> tuple[QuantizedWeight, torch.Tensor | None]:
    """One linear layer of a packed checkpoint -> (QuantizedWeight [out, in], the input
    permutation act-order GPTQ needs (x[:, perm] meets the weight's regrouped columns), or None)."""
    if method == "awq":
        # qweight [in, out / 8], qzeros [in / g, out / 8], scales [in / g, out]; w = s * (q - z).
        q = _unpack_int32(parts["qweight"], 4, -1, _AWQ_ORDER).t()
        z = _unpack_int32(parts["qzeros"], 4, -1, _AWQ_ORDER).t().float()
        s = parts["scales"].float().t()
        return QuantizedWeight(q.to(torch.int8).contiguous(), s.contiguous(), (-(s * z)).contiguous(), 4, group_size), None
    if method == "gptq":
        # qweight [in / 8, out], qzeros [in / g, out / 8] (stored minus one), scales [in / g, out],
        # g_idx [in]: the group of each input. w = s * (q - (z + 1)).
        q = _unpack_int32(parts["qweight"], 4, 0).t()  # [out, in]
        z = _unpack_int32(parts["qzeros"], 4, -1).float() + 1.0
        s = parts["scales"].float()
        k = q.shape[1]
        g_idx = parts.get("g_idx")
        natural = torch.arange(k, dtype=torch.int64) // group_size
        perm = None
        if g_idx is not None and not torch.equal(g_idx.long(), natural):
            # act-order: inputs grouped out of order. Sort the inputs by group so that groups
            # are contiguous again; the layer then reads its input in that order.
            perm = torch.argsort(g_idx.long(), stable=True)
            q = q[:, perm]
            counts = torch.bincount(g_idx.long(), minlength=s.shape[0])
            if not bool((counts[:-1] == group_size).all()):
                raise QuantizationError(f"{name}: act-order groups of unequal size; supported: group_size inputs each")
        scales = s.t().contiguous()
        mins = (-(s * z)).t().contiguous()
        return QuantizedWeight(q.to(torch.int8).contiguous(), scales, mins, 4, group_size), perm
    # compressed-tensors pack-quantized: weight_packed [out, in * bits / 32] int32 (lowest bits
    # first), weight_scale [out, in / g] (or [out, 1] by channel), weight_zero_point optional;
    # symmetric values stored with an offset of 2^(bits-1).
    out, k = (int(v) for v in parts["weight_shape"].tolist())
    q = _unpack_int32(parts["weight_packed"], bits, -1)[:, :k]
    s = parts["weight_scale"].float()
    group = k if group_size == 0 else group_size
    zp = parts.get("weight_zero_point")
    offset = 1 << (bits - 1)
    if zp is None or not bool(zp.any()):
        if bits == 8:
            return QuantizedWeight((q - offset).to(torch.int8).contiguous(), s.contiguous(), None, 8, group), None
        return QuantizedWeight(q.to(torch.int8).contiguous(), s.contiguous(), (-(s * offset)).contiguous(), 4, group), None
    raise QuantizationError(f"{name}: compressed-tensors with zero points (asymmetric); supported: symmetric")


def resolve_gguf_path(model_path: str | os.PathLike) -> str | None:
    """The GGUF file `model_path` names (a .gguf file, or a folder holding exactly one), or None."""
    model_path = os.fspath(model_path)
    if model_path.endswith(".gguf"):
        return model_path
    if os.path.isdir(model_path) and not os.path.isfile(os.path.join(model_path, "config.json")):
        files = sorted(f for f in os.listdir(model_path) if f.endswith(".gguf"))
        if len(files) == 1:
            return os.path.join(model_path, files[0])
    return None
