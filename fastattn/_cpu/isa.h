/* The instruction-set level a translation unit's kernels are compiled for.
 *
 * One build holds the kernels several times: setup.py compiles the kernel sources once per level
 * (generic x86-64, AVX2+FMA+F16C, AVX-512 F/BW/DQ/VL, AVX-512 + AVX512_BF16, AMX: AVX-512 +
 * AVX512_BF16 + AMX-BF16; or one -march=native level when asked), each with its own target flags and
 * -DFASTATTN_ISA_NAMESPACE=isa_<level>.  Every kernel header puts its code in
 * `namespace fastattn { inline namespace FASTATTN_ISA_NAMESPACE { ... } }`, so the levels'
 * templates and inline functions are distinct symbols: the linker can never merge an AVX-512
 * instance into the generic level's code.  dispatch.h picks a level at import by CPUID.
 */
#ifndef FASTATTN_ISA_H
#define FASTATTN_ISA_H

#if !defined(FASTATTN_ISA_NAMESPACE) || !defined(FASTATTN_ISA_NAME)
#error "the kernels compile through setup.py's kernel sources with -DFASTATTN_ISA_NAMESPACE=isa_<level> -DFASTATTN_ISA_NAME=\"<level>\" (setup.py passes both)"
#endif

#endif
