"""The bit tricks of kvzip/gpu/kernels/fused_fast.cu, read from the source and evaluated on the CPU.

CI has no GPU, so the CUDA C kernels never run there.  Their SIMD-within-a-register helpers are
plain integer expressions on 32-bit words, so this test reads each one out of the .cu file,
evaluates it with C's unsigned 32-bit semantics (every operation wrapped) and compares it with a
value-by-value reference over every input that matters.  A constant edited wrongly in the .cu
fails here, before a GPU run.  (tests/gpu checks the kernels' bytes against the CPU twin.)
"""
import ast
import random
import re
from pathlib import Path

import pytest

import kvzip

SOURCE = (Path(kvzip.__file__).parent / "gpu" / "kernels" / "fused_fast.cu").read_text()
U32 = 0xFFFFFFFF


def byte_perm(x: int, y: int, s: int) -> int:
    """CUDA's __byte_perm: byte k of the result is byte (selector nibble k & 7) of y:x, or, where
    the nibble's bit 3 is set, that byte's top bit replicated."""
    pool = (x | y << 32).to_bytes(8, "little")
    out = 0
    for k in range(4):
        sel = (s >> 4 * k) & 0xF
        b = pool[sel & 7]
        if sel & 8:
            b = 0xFF if b & 0x80 else 0
        out |= b << 8 * k
    return out


_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.BitAnd: lambda a, b: a & b, ast.BitOr: lambda a, b: a | b, ast.BitXor: lambda a, b: a ^ b,
        ast.LShift: lambda a, b: a << b, ast.RShift: lambda a, b: a >> b}


def _evaluate(node, env: dict) -> int:
    """A C expression over u32 values (parsed as Python: the operators used here rank the same in
    both languages), every intermediate result wrapped to 32 bits as C's unsigned arithmetic."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, env)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return env[node.id]
    if isinstance(node, ast.BinOp):
        return _OPS[type(node.op)](_evaluate(node.left, env), _evaluate(node.right, env)) & U32
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
        return ~_evaluate(node.operand, env) & U32
    if isinstance(node, ast.Call) and node.func.id == "byte_perm":
        return byte_perm(*(_evaluate(a, env) for a in node.args))
    raise AssertionError(f"not a u32 expression this test knows: {ast.dump(node)}")


def _split_top(text: str, sep: str) -> list[str]:
    """text split at sep outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def device_function(name: str):
    """fused_fast.cu's __device__ function name as a Python function of its u32 arguments.  It
    must be straight-line code: `const u32 a = ..., b = ...;` declarations, `*out = ...;` stores
    through pointer parameters and one `return ...;`.  Returns the return value, or (value,
    {pointer parameter: stored value}) when it stores through one."""
    m = re.search(r"__device__ __forceinline__ u32 " + name + r"\(([^)]*)\) \{([^{}]*)\}", SOURCE, re.S)
    assert m, f"{name} not found in fused_fast.cu"
    params = [p.split()[-1].lstrip("*") for p in m.group(1).split(",")]
    body = re.sub(r"//[^\n]*", "", m.group(2))
    body = re.sub(r"\b(0x[0-9a-fA-F]+|\d+)u\b", r"\1", body).replace("__byte_perm", "byte_perm")
    steps = []
    for statement in (s.strip() for s in body.split(";")):
        if not statement:
            continue
        if statement.startswith("const u32 "):
            for decl in _split_top(statement[len("const u32 "):], ","):
                target, expr = decl.split("=", 1)
                steps.append(("let", target.strip(), ast.parse(expr.strip(), mode="eval")))
        elif statement.startswith("return "):
            steps.append(("return", None, ast.parse(statement[len("return "):], mode="eval")))
        elif statement.startswith("*"):
            target, expr = statement[1:].split("=", 1)
            steps.append(("store", target.strip(), ast.parse(expr.strip(), mode="eval")))
        else:
            raise AssertionError(f"{name}: not straight-line u32 code: {statement!r}")

    def run(*args):
        env = dict(zip(params, args))
        stored = {}
        for kind, target, tree in steps:
            value = _evaluate(tree, env)
            if kind == "let":
                env[target] = value
            elif kind == "store":
                stored[target] = value
            else:
                return (value, stored) if stored else value
        raise AssertionError(f"{name} has no return")

    return run


def e5m2_fields(byte: int) -> int:
    """An E5M2 value's rest field: sign << 2 | mantissa."""
    return (byte >> 7) << 2 | byte & 3


def test_e5m2_rest12_packs_every_field_combination():
    rest12 = device_function("e5m2_rest12")
    rng = random.Random(0)
    for fields in range(1 << 12):
        for _ in range(2):
            w = 0
            for k in range(4):
                f = (fields >> 3 * k) & 7
                w |= ((f >> 2) << 7 | rng.getrandbits(5) << 2 | f & 3) << 8 * k  # random exponents
            assert rest12(w) >> 20 == sum(e5m2_fields((w >> 8 * k) & 0xFF) << 3 * k for k in range(4)), hex(w)


def test_e5m2_spread_rest_places_every_field_combination():
    spread = device_function("e5m2_spread_rest")
    rng = random.Random(1)
    for x in range(1 << 12):
        want = 0
        for k in range(4):
            f = (x >> 3 * k) & 7
            want |= ((f >> 2) << 7 | f & 3) << 8 * k
        assert spread(x) == want
        assert spread(x | rng.getrandbits(20) << 12) == want  # bits above the four fields are ignored


def test_lookup4_reads_the_16_entry_codebook():
    lookup4 = device_function("lookup4")
    rng = random.Random(2)
    for _ in range(3000):
        table = [rng.getrandbits(8) for _ in range(16)]
        d = [int.from_bytes(bytes(table[4 * i:4 * i + 4]), "little") for i in range(4)]
        n4 = rng.getrandbits(16)
        want = sum(table[(n4 >> 4 * k) & 15] << 8 * k for k in range(4))
        assert lookup4(n4, *d) == want


def test_pack4_and_escape_mask():
    pack4, escape_mask = device_function("pack4"), device_function("escape_mask")
    rng = random.Random(3)
    for _ in range(3000):
        codes = [rng.choice([*range(16), 0x80]) for _ in range(8)]  # 0x80: the LUT's "escape"
        lo, flags_lo = pack4(*codes[:4], 0)
        hi, flags_hi = pack4(*codes[4:], 0)
        for k, c in enumerate(codes[:4]):  # codes 0|1 in byte 0, 2|3 in byte 2
            assert (lo >> (8 * (k >> 1) * 2 + 4 * (k & 1))) & 0xF == c & 0xF
        want = sum(1 << j for j, c in enumerate(codes) if c == 0x80)
        assert escape_mask(flags_lo["flags"], flags_hi["flags"]) == want


@pytest.mark.parametrize("seed", range(3))
def test_bf16_exponents4(seed):
    exponents4 = device_function("bf16_exponents4")
    rng = random.Random(seed)
    for _ in range(2000):
        values = [rng.getrandbits(16) for _ in range(4)]
        w0, w1 = values[0] | values[1] << 16, values[2] | values[3] << 16
        assert exponents4(w0, w1) == sum(((v >> 7) & 0xFF) << 8 * k for k, v in enumerate(values))


def test_host_payload_arithmetic_matches_the_container_layout():
    """A batch's blobs are sized on the host from the totals kvz_encode publishes
    (programs.payload_bytes, finish_blob's arithmetic): that must be container.layout's payload
    length for the streams _stream_table lists with those escape counts, and its mask the .cu's."""
    from kvzip import container
    from kvzip.formats import FORMATS
    from kvzip.gpu import programs

    mask = re.search(r"#define GROUPS_MASK (0x[0-9A-Fa-f]+)ull", SOURCE)
    assert mask and int(mask.group(1), 16) == programs.GROUPS_MASK
    rng = random.Random(5)
    for fmt in FORMATS.values():
        for _ in range(300):
            n = rng.choice([1, 7, 8, 4096, 4097, rng.randrange(1, 1 << 24)])
            groups = -(-n // 8)
            plane = rng.randrange(0, groups + 1) if rng.random() < 0.3 else 0
            escapes = rng.randrange(0, n // 3 + 1)
            table = programs._stream_table(n, fmt, -(-n // 4096), {}, escapes, fmt.high_exp_bits * plane)
            offsets, payload = container.layout([nb for _, _, nb in table])
            var_base = offsets[[name for name, _, _ in table].index("esc_pos")]
            totals = escapes << 31 | plane | 1 << 63  # as published: flagged
            assert programs.payload_bytes(var_base, totals, fmt.high_exp_bits) == payload, (fmt.name, n)


def test_queue_region_matches_the_host_layout():
    """The dense kernels' chunk queues take QUEUE_WORDS words of the work region, which
    programs.py sizes; both files must agree."""
    from kvzip.gpu import programs

    words = re.search(r"#define QUEUE_WORDS (\d+)", SOURCE)
    assert words and int(words.group(1)) == programs.QUEUE_WORDS


def test_e5m2_position_tables_give_codes_and_escape_mask():
    """encode_e5m2_full ORs a group's eight lookups in the position tables (build_position_tables:
    value j's table) word by word, then takes the codes with a byte permute of the two words and
    the escape mask from bits 16 up: that must be the nibble-packed codes (escapes code 0) and
    bit j for each escaped value j."""
    entry = re.search(r"tabs\[i\] = (.*);", SOURCE)
    select = re.search(r"reinterpret_cast<u32\*>\(codes\)\[g\] = __byte_perm\(r\[0\], r\[1\], (0x[0-9a-fA-F]+)\);", SOURCE)
    mask_shift = re.search(r"return \(r\[0\] \| r\[1\]\) >> (\d+);", SOURCE)
    assert entry and select and mask_shift
    tree = ast.parse(re.sub(r"\b(0x[0-9a-fA-F]+|\d+)u\b", r"\1", entry.group(1)), mode="eval")
    table = [[_evaluate(tree, {"c": c, "j": j}) for c in range(256)] for j in range(8)]
    rng = random.Random(7)
    for _ in range(3000):
        lut = [rng.choice([*range(16), 0x80]) for _ in range(8)]  # each value's LUT byte: code or "escape"
        r0 = r1 = 0
        for j, c in enumerate(lut):
            if j < 4:
                r0 |= table[j][c]
            else:
                r1 |= table[j][c]
        codes = byte_perm(r0, r1, int(select.group(1), 16))
        assert codes == sum((c & 0xF) << 4 * j for j, c in enumerate(lut))
        assert (r0 | r1) >> int(mask_shift.group(1)) == sum(1 << j for j, c in enumerate(lut) if c == 0x80)
