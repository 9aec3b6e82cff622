/* OpenMP where the build has it, serial stand-ins where it does not.
 *
 * setup.py compiles the CPU extensions with -fopenmp when the compiler supports it; otherwise
 * _OPENMP is undefined and these stand-ins make every parallel region run on one thread, so the
 * kernels are written once and build either way. FASTATTN_OPENMP tells Python which build it got.
 */
#ifndef FASTATTN_OMP_SHIM_H
#define FASTATTN_OMP_SHIM_H

#ifdef _OPENMP
#include <omp.h>
#define FASTATTN_OPENMP 1
#define FASTATTN_OPENMP_VERSION _OPENMP
#else
#define FASTATTN_OPENMP 0
#define FASTATTN_OPENMP_VERSION 0
static inline int omp_get_max_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
static inline void omp_set_num_threads(int n) { (void)n; }
#endif

#endif
