// What every AMX kernel needs: whether this build and this process can use the tiles, and the
// tile configuration (LDTILECFG's 64-byte operand). AMX is compiled in where -march=native offers
// it (PDSERVE_AMX); Linux grants a process AMX's 8 KiB of register state only on request
// (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA), and without it the first tile instruction faults.
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

}  // namespace pdserve_amx
