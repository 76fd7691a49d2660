// The fused kernels' compile-time tunables.  Their values live in kvzip/gpu/tuning.py (one Tuning
// a format, the "macro" fields), which kvzip/gpu/loader.py renders as -D options; no file here
// defaults them, so a build without the loader's options stops here instead of running with
// values nobody chose.
//   KVZ_QUEUES           chunk queues of the dense kernels (common.cuh)
//   KVZ_PENDING          tensors a kvz_encode warp notes before publishing their counts (encode.cu)
//   KVZ_POLL_NS          kvz_decode's sleep between polls of the scan's offsets (decode.cu)
//   KVZ_DECODE_PREFETCH  kvz_decode's L2 prefetch of a chunk as it starts, FP8 and float16 (decode.cu)
//   KVZ_CHECK_MAX        escapes of a block the decode scan checks itself (escapes.cuh)
//   KVZ_CHECK_BATCH      escapes a decode-scan thread checks a round (escapes.cuh)
//   KVZ_E5M2_QUADS       whole E5M2 chunks decoded a lane per quad (decode_e5m2_quads; decode.cu)
#pragma once

#if !defined(KVZ_QUEUES) || !defined(KVZ_PENDING) || !defined(KVZ_POLL_NS) || !defined(KVZ_DECODE_PREFETCH) || \
    !defined(KVZ_CHECK_MAX) || !defined(KVZ_CHECK_BATCH) || !defined(KVZ_E5M2_QUADS)
#error "the fused kernels' tunables come from kvzip/gpu/tuning.py through kvzip/gpu/loader.py's -D options"
#endif
