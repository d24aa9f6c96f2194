"""docs/protocol.md agrees with the code: schema tables, dtypes, error codes, worked example.

The generated parts of the page sit between ``<!-- BEGIN GENERATED: name -->`` and
``<!-- END GENERATED: name -->`` markers. After changing messages.py, regenerate them::

    uv run python tests/protocol/test_codec_docs.py --write
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import io
import re
import struct
import sys
import tokenize
from pathlib import Path

import msgspec
import msgspec.inspect as mi
import pytest

from omnirl.protocol import encode, errors, messages
from omnirl.protocol.messages import MESSAGE_TYPES, Message
from omnirl.protocol.tensor_type import Tensor
from omnirl.protocol.tensors import WIRE_DTYPES

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
REGION = re.compile(
    r"(<!-- BEGIN GENERATED: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- END GENERATED: (?P=name) -->)",
    re.S,
)


# ------------------------------------------------------------------------ schema tables


def _anchor(cls: type) -> str:
    if issubclass(cls, Message):
        return cls.__struct_config__.tag  # GitHub keeps "_" in heading anchors
    return f"struct-{cls.__name__.lower()}"


def _wire_type(t: mi.Type) -> str:
    simple = {
        mi.StrType: "str",
        mi.IntType: "int",
        mi.FloatType: "float",
        mi.BoolType: "bool",
        mi.NoneType: "nil",
        mi.AnyType: "any",
    }
    if type(t) in simple:
        return simple[type(t)]
    if isinstance(t, mi.Metadata):
        return _wire_type(t.type)
    if isinstance(t, mi.CustomType) and t.cls is Tensor:
        return "tensor"
    if isinstance(t, mi.LiteralType):
        return " or ".join(f'"{value}"' for value in t.values)
    if isinstance(t, (mi.ListType, mi.VarTupleType)):
        return f"array of {_wire_type(t.item_type)}"
    if isinstance(t, mi.TupleType):
        return "[" + ", ".join(_wire_type(item) for item in t.item_types) + "]"
    if isinstance(t, mi.DictType):
        return f"map {_wire_type(t.key_type)} → {_wire_type(t.value_type)}"
    if isinstance(t, mi.UnionType):
        return " or ".join(_wire_type(item) for item in t.types)
    if isinstance(t, mi.StructType):
        return f"[{t.cls.__name__}](#{_anchor(t.cls)})"
    raise TypeError(f"no wire name for {t!r}")


def _field_comments() -> dict[tuple[str, str], str]:
    """``# comment`` at the end of each field line of messages.py, by (class, field)."""
    source = inspect.getsource(messages)
    comments = {
        tok.start[0]: tok.string.lstrip("# ").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if (
                    isinstance(stmt, ast.AnnAssign)
                    and isinstance(stmt.target, ast.Name)
                    and stmt.end_lineno in comments
                ):
                    out[(node.name, stmt.target.id)] = comments[stmt.end_lineno]
    return out


def _default(field: mi.Field) -> str:
    if field.required:
        return "required"
    value = (
        field.default_factory() if field.default_factory is not msgspec.NODEFAULT else field.default
    )
    return "`nil`" if value is None else f"`{msgspec.json.encode(value).decode()}`"


def _struct_section(info: mi.StructType, comments: dict) -> list[str]:
    cls = info.cls
    doc = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " ")
    if issubclass(cls, Message):
        lines = [f"### {cls.__struct_config__.tag}", "", f"Class `{cls.__name__}`. {doc}".strip()]
    else:
        lines = [f"### struct {cls.__name__}", "", doc or "A nested map (no `kind`, no `v`)."]
    finite = set(getattr(cls, "finite_fields", ()))
    lines += ["", "| key | type | default | notes |", "|---|---|---|---|"]
    if issubclass(cls, Message):
        lines.append(f'| `kind` | str | required | `"{cls.__struct_config__.tag}"` |')
    for f in info.fields:
        notes = comments.get((cls.__name__, f.name), "")
        if f.name == "v":
            notes = "protocol [major, minor] of the sender"
        if f.name in finite:
            notes = f"{notes}; finite" if notes else "finite"
        lines.append(f"| `{f.encode_name}` | {_wire_type(f.type)} | {_default(f)} | {notes} |")
    return [*lines, ""]


def schema_markdown() -> str:
    comments = _field_comments()
    infos = mi.multi_type_info(MESSAGE_TYPES)
    nested: dict[type, mi.StructType] = {}

    def collect(t: mi.Type) -> None:
        if isinstance(t, mi.StructType):
            if t.cls not in nested and not issubclass(t.cls, Message):
                nested[t.cls] = t
                for f in t.fields:
                    collect(f.type)
            return
        for attr in ("types", "item_types"):
            for child in getattr(t, attr, ()):
                collect(child)
        for attr in ("type", "item_type", "value_type"):
            child = getattr(t, attr, None)
            if isinstance(child, mi.Type):
                collect(child)

    for info in infos:
        for f in info.fields:
            collect(f.type)
    lines = ["## Message kinds", ""]
    for info in infos:
        lines += _struct_section(info, comments)
    lines += ["## Nested structs", ""]
    for info in nested.values():
        lines += _struct_section(info, comments)
    return "\n".join(lines)


def dtypes_markdown() -> str:
    lines = ["| wire name | bytes per element | layout |", "|---|---|---|"]
    lines += [f"| `{d.name}` | {d.itemsize} | {d.layout} |" for d in WIRE_DTYPES.values()]
    return "\n".join(lines) + "\n"


def errors_markdown() -> str:
    lines = ["| `Refusal.code` | error class | meaning |", "|---|---|---|"]
    for name in errors.__all__:
        cls = getattr(errors, name)
        first = inspect.cleandoc(cls.__doc__ or "").split("\n")[0]
        lines.append(f"| `{cls.code}` | `{name}` | {first} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------- worked example


def example_messages() -> dict[str, Message]:
    import torch

    weight = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float32)
    raw = weight.numpy().tobytes()
    return {
        "heartbeat": messages.Heartbeat(
            worker_id="r1", role="rollout", policy_version=3, leases=["L7"], time=0.5
        ),
        "weight-update": messages.WeightUpdate(
            version=1,
            format="full",
            chunk=0,
            num_chunks=1,
            names=["w"],
            tensors=[weight],
            checksum=hashlib.sha256(raw).hexdigest(),
            total_bytes=len(raw),
        ),
    }


def hex_dump(data: bytes) -> str:
    rows = []
    for offset in range(0, len(data), 16):
        chunk = data[offset : offset + 16]
        text = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        rows.append(f"{offset:04x}  {chunk.hex(' '):<47}  {text}")
    return "\n".join(rows)


def annotate_msgpack(data: bytes) -> str:
    """One line per msgpack token: offset, bytes, meaning (the subset headers use)."""
    rows: list[str] = []
    pos = 0

    def emit(start: int, end: int, meaning: str, depth: int) -> None:
        shown = data[start:end].hex(" ")
        if len(shown) > 35:
            shown = shown[:32] + "..."
        rows.append(f"{start:04x}  {shown:<35}  {'  ' * depth}{meaning}")

    def value(depth: int) -> None:
        nonlocal pos
        start, b = pos, data[pos]
        pos += 1
        if b <= 0x7F:
            emit(start, pos, f"int {b}", depth)
        elif b >= 0xE0:
            emit(start, pos, f"int {b - 0x100}", depth)
        elif 0xA0 <= b <= 0xBF or b == 0xD9:
            n = b & 0x1F if b != 0xD9 else data[pos]
            pos += b == 0xD9
            pos += n
            emit(start, pos, f"str {data[pos - n : pos].decode()!r}", depth)
        elif 0x80 <= b <= 0x8F or b == 0xDE:
            n = b & 0x0F if b != 0xDE else struct.unpack(">H", data[pos : pos + 2])[0]
            pos += 2 * (b == 0xDE)
            emit(start, pos, f"map of {n}", depth)
            for _ in range(2 * n):
                value(depth + 1)
        elif 0x90 <= b <= 0x9F or b == 0xDC:
            n = b & 0x0F if b != 0xDC else struct.unpack(">H", data[pos : pos + 2])[0]
            pos += 2 * (b == 0xDC)
            emit(start, pos, f"array of {n}", depth)
            for _ in range(n):
                value(depth + 1)
        elif b in (0xC0, 0xC2, 0xC3):
            emit(start, pos, {0xC0: "nil", 0xC2: "false", 0xC3: "true"}[b], depth)
        elif b in (0xCA, 0xCB):
            fmt, size = (">f", 4) if b == 0xCA else (">d", 8)
            (number,) = struct.unpack(fmt, data[pos : pos + size])
            pos += size
            emit(start, pos, f"float{size * 8} {number!r}", depth)
        elif b in (0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD1, 0xD2, 0xD3):
            fmt = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q"} | {
                0xD0: ">b",
                0xD1: ">h",
                0xD2: ">i",
                0xD3: ">q",
            }
            size = struct.calcsize(fmt[b])
            (number,) = struct.unpack(fmt[b], data[pos : pos + size])
            pos += size
            emit(start, pos, f"int {number}", depth)
        else:
            raise ValueError(f"byte {b:#x} at {start} is outside the annotated subset")

    value(0)
    assert pos == len(data), "trailing bytes"
    return "\n".join(rows)


def example_markdown(name: str) -> str:
    frames = [bytes(f) for f in encode(example_messages()[name])]
    parts = [f"Frame 0, the header ({len(frames[0])} bytes):", "", "```text", hex_dump(frames[0])]
    parts += ["```", "", "The same bytes, token by token:", "", "```text"]
    parts += [annotate_msgpack(frames[0]), "```", ""]
    for i, frame in enumerate(frames[1:], start=1):
        parts += [f"Frame {i} ({len(frame)} bytes):", "", "```text", hex_dump(frame), "```", ""]
    return "\n".join(parts)


def generated() -> dict[str, str]:
    return {
        "dtypes": dtypes_markdown(),
        "schema": schema_markdown(),
        "errors": errors_markdown(),
        "example-heartbeat": example_markdown("heartbeat"),
        "example-weight-update": example_markdown("weight-update"),
    }


def regions(text: str) -> dict[str, str]:
    return {match["name"]: match["body"] for match in REGION.finditer(text)}


def write_doc() -> None:
    parts = generated()
    text = DOC.read_text()
    missing = set(parts) - set(regions(text))
    if missing:
        raise SystemExit(f"{DOC} lacks GENERATED regions {sorted(missing)}")
    DOC.write_text(REGION.sub(lambda m: m[1] + parts[m["name"]] + m[4], text))


# --------------------------------------------------------------------------------- tests

REGENERATE = "regenerate with: uv run python tests/protocol/test_codec_docs.py --write"


@pytest.mark.parametrize("name", list(generated()))
def test_doc_region_matches_code(name):
    found = regions(DOC.read_text())
    assert name in found, f"docs/protocol.md lacks the {name} region"
    assert found[name] == generated()[name], f"docs/protocol.md: {name} is stale; {REGENERATE}"


def test_worked_example_decodes_from_the_doc_bytes():
    """Bytes read back from the page's hex dumps decode to the example message."""
    from omnirl.protocol import decode

    body = regions(DOC.read_text())["example-weight-update"]
    blocks = re.findall(
        r"Frame \d+(?:, the header)? \((\d+) bytes\):\n\n```text\n(.*?)```", body, re.S
    )
    frames = []
    for size, dump in blocks:
        hex_text = "".join(line[6:53] for line in dump.splitlines())
        frames.append(bytes.fromhex(hex_text))
        assert len(frames[-1]) == int(size)
    msg = decode(frames)
    assert msg.tensors[0].tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert msg.checksum == hashlib.sha256(frames[1]).hexdigest()


def test_client_written_from_the_doc_interoperates():
    """The page's stand-alone client (numpy + untyped msgpack) talks to the reference codec."""
    import numpy as np
    import torch
    from test_codec_samples import diffusion_group

    from omnirl.protocol import decode

    text = DOC.read_text()
    code = re.search(r"<!-- client-example -->\n```python\n(.*?)```", text, re.S)[1]
    client: dict = {}
    exec(compile(code, "docs/protocol.md client-example", "exec"), client)

    arrays = [np.arange(6, dtype="<f4").reshape(2, 3).T, np.array([True, False]), np.int64(7)]
    frames = client["weight_update"](4, ["a", "b", "c"], [np.asarray(a) for a in arrays])
    msg = decode(frames)
    assert (msg.version, msg.names) == (4, ["a", "b", "c"])
    for got, want in zip(msg.tensors, arrays, strict=True):
        assert got.shape == want.shape and np.array_equal(got.numpy(), want)

    group = diffusion_group()
    header, tensors = client["read"]([bytes(f) for f in encode(group)])
    assert header["kind"] == "diffusion_group" and header["group_id"] == group.group_id
    assert np.array_equal(tensors["latents"], group.latents.numpy())
    assert np.array_equal(tensors["prompt_embeds"], group.prompt_embeds.float().numpy())
    assert np.array_equal(tensors["prompt_embeds_mask"], group.prompt_embeds_mask.numpy())
    assert tensors["images"].dtype == np.uint8
    assert torch.equal(torch.from_numpy(tensors["seeds"].copy()), group.seeds)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_doc()
        print(f"wrote {DOC}")
    else:
        print(__doc__)
