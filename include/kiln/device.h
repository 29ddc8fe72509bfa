// Where a tensor lives: the CPU or a CUDA device.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace kiln {

enum class DeviceType : uint8_t { cpu = 0, cuda = 1 };
inline constexpr int kNumDeviceTypes = 2;

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;  // CUDA ordinal; always 0 for the CPU

  constexpr Device() = default;
  constexpr Device(DeviceType t, int i = 0) : type(t), index(t == DeviceType::cpu ? 0 : i) {}  // NOLINT
  // "cpu", "cuda", "cuda:1". Throws ValueError on anything else.
  Device(const char* spec);         // NOLINT: implicit, like torch.device("cuda:0")
  Device(std::string_view spec);    // NOLINT

  bool is_cpu() const { return type == DeviceType::cpu; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  std::string str() const;  // "cpu", "cuda:0"
  friend bool operator==(const Device&, const Device&) = default;
};

inline constexpr Device kCPU{DeviceType::cpu, 0};
inline Device cuda_device(int index = 0) { return Device(DeviceType::cuda, index); }

namespace cuda {
// Whether Kiln was built with CUDA and a GPU is visible.
bool is_available();
int device_count();
}  // namespace cuda

}  // namespace kiln
