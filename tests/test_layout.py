"""kvzip/layout.py, the blob layout's one definition, and the C header generated from it."""
import random

from kvzip import container, layout


def test_prefix_fields_are_the_documented_struct():
    assert layout.PREFIX.format == "<8sHHIQQIII4x" and layout.PREFIX_SIZE == 48
    at = 0
    for f in layout.PREFIX_FIELDS:
        assert f.offset == at and f.span == slice(at, at + f.size)
        at += f.size
    assert at == layout.PREFIX_SIZE == layout.TABLE_AT
    expect = {"magic": 0, "version": 8, "flags": 10, "header_len": 12, "payload_len": 16, "checksum": 24,
              "meta_len": 32, "stream_count": 36, "header_crc": 40, "reserved": 44}
    assert {f.name: f.offset for f in layout.PREFIX_FIELDS} == expect
    # PREFIX.unpack gives the named values in order, and Field.read reads each of them.
    blob = container.build_header({"x": 1}, [("codes", "uint8", 5), ("esc_pos", "uint16", 6)], container.FLAG_CHECKSUM, 7)
    values = dict(zip(layout.PREFIX_VALUES, layout.PREFIX.unpack_from(blob)))
    for name, value in values.items():
        if name != "magic":
            assert layout.FIELD[name].read(blob) == value, name
    assert values["magic"] == layout.MAGIC and values["checksum"] == 7 and values["stream_count"] == 2


def test_container_names_are_the_layouts():
    assert container.PREFIX is layout.PREFIX and container.ALIGN == layout.ALIGN == 16
    assert container.STREAM_ORDER == layout.STREAM_ORDER and container.layout is layout.place
    assert container.canonical_order is layout.canonical_order


def test_escape_arithmetic_is_place():
    """escape_layout (the encoders' sizing, finish_blob's arithmetic) places the escape streams
    as place() places them after the fixed streams, and escapes_laid_out accepts exactly that."""
    rng = random.Random(3)
    for _ in range(3000):
        fixed = [rng.randrange(0, 1 << 20) for _ in range(rng.randrange(1, 5))]
        escapes, high = rng.randrange(0, 1 << 16), rng.randrange(0, 1 << 16)
        offsets, payload = layout.place(fixed + [layout.ESC_POS_BYTES * escapes, escapes, high])
        got = layout.escape_layout(offsets[-3], escapes, high)
        assert got == (*offsets[-3:], payload)
        assert layout.escape_payload_len(offsets[-3], escapes, high) == payload
        entries = (offsets[-3], 2 * escapes, offsets[-2], escapes, offsets[-1], high)
        assert layout.escapes_laid_out(payload, entries)
        assert not layout.escapes_laid_out(payload + 16, entries)
        assert not layout.escapes_laid_out(payload, (offsets[-3], 2 * escapes, offsets[-2] + 16, escapes,
                                                     offsets[-1], high))


def test_crc_blanked_and_seal_are_inverse():
    raw = bytearray(container.build_header({"a": [1, 2]}, [("data", "uint8", 3)], 0))
    stored = layout.HEADER_CRC.read(raw)
    assert layout.crc_blanked(raw) == (stored, stored)
    assert layout.HEADER_CRC.read(raw) == 0
    layout.seal(raw)
    assert layout.HEADER_CRC.read(raw) == stored


def test_layout_cuh_is_generated():
    """kvzip/gpu/kernels/layout.cuh is what kvzip.layout.cuh() gives (regenerate it with
    `python -m kvzip.gpu.headers --write` after changing kvzip/layout.py)."""
    assert layout.cuh_path().read_text() == layout.cuh()


def test_layout_cuh_values():
    """layout.cuh's #defines are kvzip/layout.py's values, and the kernels take PLANE from it."""
    import re

    defines = dict(re.findall(r"^#define (KVZ_\w+|PLANE) (\w+)", layout.cuh(), re.M))
    for f in layout.PREFIX_FIELDS:
        assert int(defines[f"KVZ_{f.name.upper()}_AT"]) == f.offset
        assert int(defines[f"KVZ_{f.name.upper()}_SIZE"]) == f.size
    assert int(defines["KVZ_PREFIX_SIZE"]) == layout.PREFIX_SIZE
    assert int(defines["KVZ_ALIGN"]) == layout.ALIGN and int(defines["KVZ_TABLE_AT"]) == layout.TABLE_AT
    assert int(defines["KVZ_ENTRY_SIZE"]) == layout.ENTRY_SIZE
    assert int(defines["KVZ_ESCAPE_ENTRIES_SIZE"]) == layout.ESCAPES.size
    assert int(defines["KVZ_ESC_POS_BYTES"]) == layout.ESC_POS_BYTES
    assert int(defines["PLANE"].rstrip("u"), 16) == layout.PLANE
    for k, name in enumerate(layout.ESCAPE_STREAMS):
        assert int(defines[f"KVZ_{name.upper()}_INDEX"]) == k
    from kvzip.gpu import loader

    sources = loader.sources()
    assert '#include "layout.cuh"' in sources["common.cuh"]
    assert not any("#define PLANE" in text for name, text in sources.items() if name != "layout.cuh")


