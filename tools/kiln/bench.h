// `kiln bench`: model benchmarks (see bench.cpp).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace kiln::nn {
class Module;
}

namespace kiln::cli {
// Option helpers the model benches share (bench.cpp). `bench` names the bench in messages
// ("gpt2" -> "[kiln bench gpt2] ...").
// The image classifiers the model benches time: densenet121, densenet169, resnet18, resnet50.
std::shared_ptr<nn::Module> image_model(const std::string& bench, const std::string& name, int64_t num_classes);
// An option's value as a positive integer; anything else is a ValueError naming the option.
int64_t positive_option(const std::string& bench, const std::string& option, const std::string& text);
// A comma-separated --modes value, each one of `allowed` (an empty piece is an unknown mode).
std::vector<std::string> parse_modes(const std::string& bench, const std::string& text,
                                     std::initializer_list<const char*> allowed);
// Seconds spent in backend compiles so far (compiler::compile_time_table()'s backend_compile rows).
double backend_compile_seconds();

int run_bench(const std::vector<std::string>& args);
// `kiln bench gpt2` (bench_gpt2.cpp): generation with a growing sequence, eager vs static vs dynamic.
int run_gpt2_bench(const std::vector<std::string>& args);
// `kiln bench batch-sizes` (bench_batch_sizes.cpp): one model at every batch size, eager vs dynamic.
int run_batch_sizes_bench(const std::vector<std::string>& args);
// `kiln bench program` (bench_program.cpp): exported programs vs compile(), and many callers.
int run_program_bench(const std::vector<std::string>& args);
// `kiln bench ddp` (bench_ddp.cpp): DistributedDataParallel training throughput and scaling.
int run_ddp_bench(const std::vector<std::string>& args);
}
