// What every AMX kernel needs: whether this build and this process can use the tiles, and the
// tile configuration (LDTILECFG's 64-byte operand). AMX is compiled in where the build's flags
// offer it (PDSERVE_AMX: the amx variant of kernels/variants.py, or -march=native on an AMX CPU);
// Linux grants a process AMX's 8 KiB of register state only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA), and without it the first tile instruction faults.
// The configuration is per thread and other code (oneDNN) sets its own, so each kernel loads its
// configuration on the thread that computes, before its first tile instruction.
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define PDSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

// Without AMX, a CPU with AVX512-BF16 (Zen 4, Cooper Lake) computes the same products from the
// same packed layout with VDPBF16PS: a row of a "B" tile (16 columns by a pair of k) is one 512-bit
// register, which the instruction multiplies by a broadcast pair of x and adds into 16 float32
// lanes. The tile kernels then run on it at full speed instead of through their portable loops.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PDSERVE_AVX512_BF16 1
#include <immintrin.h>

#include <cstring>
#endif

namespace pdserve_amx {

#if defined(PDSERVE_AMX)

inline bool ready() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void set(int tile, int num_rows, int bytes_per_row) {
    rows[tile] = static_cast<uint8_t>(num_rows);
    colsb[tile] = static_cast<uint16_t>(bytes_per_row);
  }
  void load() const {
    _tile_loadconfig(this);
    asm volatile("" ::: "memory");
  }
};

#else

inline bool ready() { return false; }

#endif

#if defined(PDSERVE_AVX512_BF16)
// The pair of bfloat16 at p in all 16 lanes: the "A" side of a VDPBF16PS product.
inline __m512bh broadcast_pair(const void* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
}
#endif

// Which instructions run the tile kernels in this build and process: "amx", "avx512_bf16" or
// "portable" (a plain loop that keeps the layouts tested everywhere, far too slow to pick).
inline const char* tile_kernel() {
  if (ready()) return "amx";
#if defined(PDSERVE_AVX512_BF16)
  return "avx512_bf16";
#else
  return "portable";
#endif
}

}  // namespace pdserve_amx
