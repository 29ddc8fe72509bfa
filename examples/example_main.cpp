// main() for a standalone example program: runs the examples linked into it.
#include <iostream>

#include "example.h"
#include "kiln/error.h"

int main() {
  try {
    for (const auto& e : kiln::examples::registry()) e.run(std::cout);
  } catch (const kiln::Error& err) {
    std::cerr << err.what() << "\n";
    return 1;
  }
  return 0;
}
