"""The one exception a bad blob raises."""


class FormatError(ValueError):
    """A blob (or a stream inside it) is malformed, truncated, forged or corrupted.

    It is a ValueError so callers that already guard decoding with ``except ValueError`` keep working.
    """


# The decode error codes of the fused split/pack/escape path: the CPU twin returns one, the CUDA
# kernels store one in a flag word (the first problem of each blob).  0 means no error.
DECODE_ERRORS = {
    1: "a chunk claims more escapes than an escape list may hold",
    2: "escape counts disagree with the length of the escape streams",
    3: "an escape position lies outside its chunk or breaks increasing order",
    4: "an escaped exponent is out of range for the format",
    5: "plane-coded chunks disagree with the length of the exp_high stream",
}


# The decode error codes of ChannelPack (the ratio mode), as its CPU kernels return them.
CHANNEL_DECODE_ERRORS = {
    1: "a chunk claims more escapes and second-level codes than a listed chunk may hold",
    2: "escape counts disagree with the length of the escape streams",
    3: "an escape position lies outside its chunk or breaks increasing order",
    4: "an escaped exponent is out of range for the format",
    5: "plane-coded chunks disagree with the length of the exp_high stream",
    6: "second-level counts disagree with the chunks' codes or the length of the sec_codes stream",
}

# The decode error codes of ChannelRans (the storage mode), as its CPU kernels return them.
RANS_DECODE_ERRORS = {
    1: "a chunk's lane state is below 2**16",
    2: "a chunk's word count disagrees with the words its lanes read or with the length of the words stream",
    3: "a chunk's escape count disagrees with the escapes it decodes or with the length of the esc_exp stream",
    4: "an escaped exponent is out of range for the format or lies inside its table",
    5: "a chunk's lane does not end at the initial state 2**16 (a corrupted chunk)",
}


def decode_error_text(code: int) -> str:
    """What a decode error code means."""
    return DECODE_ERRORS.get(code, f"decode error {code}")
