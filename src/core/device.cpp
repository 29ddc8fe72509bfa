#include "kiln/device.h"

#include <charconv>
#include <string>

#include "kiln/error.h"

namespace kiln {

Device::Device(const char* spec) : Device(std::string_view(spec)) {}

Device::Device(std::string_view spec) {
  auto bad = [&] {
    return ValueError("[kiln::Device] invalid device string '" + std::string(spec) +
                      "'. Use \"cpu\", \"cuda\" or \"cuda:N\".");
  };
  if (spec == "cpu") {
    type = DeviceType::cpu;
    index = 0;
    return;
  }
  if (spec.substr(0, 4) != "cuda") throw bad();
  type = DeviceType::cuda;
  index = 0;
  if (spec.size() == 4) return;
  if (spec[4] != ':' || spec.size() == 5) throw bad();
  auto digits = spec.substr(5);
  auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
  if (ec != std::errc() || ptr != digits.data() + digits.size() || index < 0) throw bad();
}

std::string Device::str() const {
  if (type == DeviceType::cpu) return "cpu";
  return "cuda:" + std::to_string(index);
}

}  // namespace kiln
