/* The instruction-set levels this build holds, lowest first, and which of them the CPU can run.
 *
 * setup.py defines FASTATTN_LEVEL_<NAME> for each level it compiled the kernels for; this header
 * (compiled into _flash with baseline flags) declares their tables.  A level runs where CPUID
 * reports every extension its flags enable and the OS saves the registers it uses; GCC's and
 * Clang's __builtin_cpu_supports check both (XGETBV for the AVX and AVX-512 state).  The native
 * level (FASTATTN_NATIVE=1, -march=native) is taken to run on the machine that built it, once the
 * OS has granted the AMX tile registers where that machine has them.
 * fastattn/_cpu/isa.py chooses among the runnable levels (the highest, or FASTATTN_ISA).
 */
#ifndef FASTATTN_DISPATCH_H
#define FASTATTN_DISPATCH_H

#include "kernel_table.h"

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace fastattn {

#if defined(FASTATTN_LEVEL_GENERIC)
namespace isa_generic { const KernelTable* kernel_table(); }
#endif
#if defined(FASTATTN_LEVEL_AVX2)
namespace isa_avx2 { const KernelTable* kernel_table(); }
#endif
#if defined(FASTATTN_LEVEL_AVX512)
namespace isa_avx512 { const KernelTable* kernel_table(); }
#endif
#if defined(FASTATTN_LEVEL_AVX512BF16)
namespace isa_avx512bf16 { const KernelTable* kernel_table(); }
#endif
#if defined(FASTATTN_LEVEL_AMX)
namespace isa_amx { const KernelTable* kernel_table(); }
#endif
#if defined(FASTATTN_LEVEL_NATIVE)
namespace isa_native { const KernelTable* kernel_table(); }
#endif

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
static inline bool cpu_runs_avx2() {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
static inline bool cpu_runs_avx512() {
    return cpu_runs_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}
static inline bool cpu_runs_avx512bf16() { return cpu_runs_avx512() && __builtin_cpu_supports("avx512bf16"); }
/* AMX also needs the kernel's leave to use the tile data registers (Linux asks each process to
 * request it, ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); CPUID and XCR0 alone are not enough. */
static inline bool os_grants_amx() {
#if defined(__linux__)
    const long arch_req_xcomp_perm = 0x1023, xfeature_xtiledata = 18;
    return syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0;
#else
    return false;
#endif
}
static inline bool cpu_runs_amx() {
    return cpu_runs_avx512bf16() && __builtin_cpu_supports("amx-tile") &&
           __builtin_cpu_supports("amx-bf16") && os_grants_amx();
}
/* The native level runs on the machine that built it, but where that CPU has AMX, -march=native
 * compiled the AMX kernels in, and their first tile instruction faults unless the process asked
 * for the tile registers first (a native build on a Xeon with AMX crashed in its bfloat16 tests). */
static inline bool cpu_runs_native() { return !__builtin_cpu_supports("amx-tile") || os_grants_amx(); }
#else
static inline bool cpu_runs_avx2() { return false; }
static inline bool cpu_runs_avx512() { return false; }
static inline bool cpu_runs_avx512bf16() { return false; }
static inline bool cpu_runs_amx() { return false; }
static inline bool cpu_runs_native() { return true; }
#endif

struct IsaLevel {
    const KernelTable* table;
    bool runs; /* this CPU can run it */
};

/* The build's levels, lowest first, into `levels` (room for 8); returns how many. */
static inline int build_levels(IsaLevel* levels) {
    int count = 0;
#if defined(FASTATTN_LEVEL_GENERIC)
    levels[count++] = IsaLevel{isa_generic::kernel_table(), true};
#endif
#if defined(FASTATTN_LEVEL_AVX2)
    levels[count++] = IsaLevel{isa_avx2::kernel_table(), cpu_runs_avx2()};
#endif
#if defined(FASTATTN_LEVEL_AVX512)
    levels[count++] = IsaLevel{isa_avx512::kernel_table(), cpu_runs_avx512()};
#endif
#if defined(FASTATTN_LEVEL_AVX512BF16)
    levels[count++] = IsaLevel{isa_avx512bf16::kernel_table(), cpu_runs_avx512bf16()};
#endif
#if defined(FASTATTN_LEVEL_AMX)
    levels[count++] = IsaLevel{isa_amx::kernel_table(), cpu_runs_amx()};
#endif
#if defined(FASTATTN_LEVEL_NATIVE)
    levels[count++] = IsaLevel{isa_native::kernel_table(), cpu_runs_native()};
#endif
    return count;
}

}  // namespace fastattn

#endif
