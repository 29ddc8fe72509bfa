#include "kiln/threading.h"

#include <omp.h>

#include "kiln/error.h"

namespace kiln {

int get_num_threads() { return omp_get_max_threads(); }

void set_num_threads(int n) {
  KILN_CHECK(n > 0, ValueError, "[kiln::set_num_threads] the number of threads must be positive, got " +
                                    std::to_string(n) + ".");
  omp_set_num_threads(n);
}

}  // namespace kiln
