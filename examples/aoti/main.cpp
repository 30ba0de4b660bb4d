// A whole detector from C++, no Python: loads the AOTInductor package that
// export_detector.py wrote (a small transformers DeformableDetrModel whose
// attention runs on ms_deform_attn), runs it on the inputs saved beside it,
// checks its outputs against eager PyTorch's, and times one image.
//
//   aoti_detector model.pt2 io.pt [runs]
//
// Exit status 0 when the outputs match within 1e-5 (relative norm).
#include <ATen/Context.h>
#include <ms_deform_attn/ms_deform_attn.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#ifdef USE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace {

c10::Dict<c10::IValue, c10::IValue> load_tensors(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  TORCH_CHECK(file, "cannot open ", path);
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  return torch::pickle_load(bytes).toGenericDict();
}

void synchronize(const c10::Device& device) {
#ifdef USE_CUDA
  if (device.is_cuda()) cudaDeviceSynchronize();
#else
  (void)device;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s model.pt2 io.pt [runs]\n", argv[0]);
    return 2;
  }
  const int runs = argc > 3 ? std::stoi(argv[3]) : 20;
  // The package calls the operator through the dispatcher: the library
  // registers it when loaded (this call keeps the link).
  std::printf("ms_deform_attn %s\n", ms_deform_attn_library_version());

  torch::inductor::AOTIModelPackageLoader loader(argv[1]);
  const auto io = load_tensors(argv[2]);
  const auto metadata = loader.get_metadata();
  const auto key = metadata.find("AOTI_DEVICE_KEY");
  const std::string device_name = key != metadata.end() ? key->second : "cpu";
  const c10::Device device(device_name);
  std::vector<torch::Tensor> inputs = {io.at("pixel_values").toTensor().to(device)};
  const torch::NoGradGuard no_grad;

  // fp32 convolutions in IEEE precision, as the export script's eager
  // reference: with cuDNN's default TF32, two algorithm choices for the same
  // convolution differ by ~1e-4.
  at::globalContext().setAllowTF32CuDNN(false);
  std::vector<torch::Tensor> outputs = loader.run(inputs);
  const char* names[] = {"last_hidden_state", "encoder_last_hidden_state"};
  bool ok = outputs.size() == 2;
  for (size_t i = 0; i < std::min<size_t>(outputs.size(), 2); ++i) {
    const auto expected = io.at(names[i]).toTensor().to(torch::kDouble);
    const auto got = outputs[i].cpu().to(torch::kDouble);
    const double err = ((got - expected).norm() / expected.norm()).item<double>();
    const bool good = got.sizes() == expected.sizes() && err <= 1e-5;
    std::printf("%-26s %s rel err %.2e (tolerance 1e-5) %s\n", names[i],
                c10::str(got.sizes()).c_str(), err, good ? "ok" : "FAILED");
    ok = ok && good;
  }

  // Latency of one call (the inputs already on the device), median of runs.
  std::vector<double> ms;
  for (int r = 0; r < runs + 3; ++r) {
    synchronize(device);
    const auto t0 = std::chrono::steady_clock::now();
    outputs = loader.run(inputs);
    synchronize(device);
    const auto t1 = std::chrono::steady_clock::now();
    if (r >= 3) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  if (!ms.empty()) {
    std::printf("latency on %s: %.3f ms (median of %d runs)\n", device_name.c_str(), ms[ms.size() / 2],
                runs);
  }
  std::printf(ok ? "outputs match eager PyTorch\n" : "outputs differ from eager PyTorch\n");
  return ok ? 0 : 1;
}
