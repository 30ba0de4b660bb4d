// Forward and backward of ms_deform_attn and ms_deform_attn_fused from C++,
// checked against a double-precision computation: on the CPU, and on CUDA
// when a GPU is there.
// Exit status 0 when every check passes.
#include <ms_deform_attn/ms_deform_attn.h>
#include <torch/torch.h>

#include <cstdio>
#include <vector>

namespace {

// The operator's definition in plain ATen ops (float64, differentiable):
// bilinear sampling with zeros outside the map, pixel x = loc_x * W - 0.5.
torch::Tensor reference(const torch::Tensor& value, const std::vector<int64_t>& hw,
                        const torch::Tensor& loc, const torch::Tensor& attn) {
  const int64_t N = value.size(0), M = value.size(2), D = value.size(3);
  const int64_t Lq = loc.size(1), L = loc.size(3);
  auto out = torch::zeros({N, Lq, M, D}, value.options());
  auto n_idx = torch::arange(N, value.options().dtype(torch::kLong)).view({N, 1, 1, 1});
  auto m_idx = torch::arange(M, value.options().dtype(torch::kLong)).view({1, 1, M, 1});
  int64_t start = 0;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t H = hw[2 * l], W = hw[2 * l + 1];
    auto x = loc.select(3, l).select(-1, 0) * W - 0.5;  // (N, Lq, M, P)
    auto y = loc.select(3, l).select(-1, 1) * H - 0.5;
    auto a = attn.select(3, l);
    auto x0 = x.detach().floor(), y0 = y.detach().floor();
    for (int dy = 0; dy < 2; ++dy) {
      for (int dx = 0; dx < 2; ++dx) {
        auto xi = x0 + dx, yi = y0 + dy;
        auto wgt = (1 - (x - xi).abs()) * (1 - (y - yi).abs());
        auto ok = (xi >= 0) & (xi < W) & (yi >= 0) & (yi < H);
        auto pix = start + (yi.clamp(0, H - 1) * W + xi.clamp(0, W - 1)).to(torch::kLong);
        auto v = value.index({n_idx, pix, m_idx});  // (N, Lq, M, P, D)
        out = out + ((wgt * ok * a).unsqueeze(-1) * v).sum(3);
      }
    }
    start += H * W;
  }
  return out.reshape({N, Lq, M * D});
}

double rel_err(const torch::Tensor& got, const torch::Tensor& want) {
  return ((got.to(torch::kDouble) - want).norm() / want.norm()).item<double>();
}

bool check(const char* what, double err, double tol) {
  std::printf("  %-34s rel err %.2e (tolerance %.0e) %s\n", what, err, tol,
              err <= tol ? "ok" : "FAILED");
  return err <= tol;
}

bool run(torch::Device device, torch::Dtype dtype, double tol) {
  torch::manual_seed(0);
  const int64_t N = 2, M = 4, D = 16, Lq = 50, P = 4;
  const std::vector<int64_t> hw = {12, 16, 6, 8, 3, 4};
  const int64_t L = 3, S = 12 * 16 + 6 * 8 + 3 * 4;
  auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  auto value64 = torch::randn({N, S, M, D}, f64);
  auto loc64 = torch::rand({N, Lq, M, L, P, 2}, f64) * 1.2 - 0.1;  // some outside the map
  auto attn64 = torch::rand({N, Lq, M, L, P}, f64);
  auto grad64 = torch::randn({N, Lq, M * D}, f64);

  // The operator: value in `dtype`, locations and weights in float32 (float64
  // with a float64 value).
  const auto loc_dtype = dtype == torch::kDouble ? torch::kDouble : torch::kFloat;
  auto value = value64.to(device, dtype).requires_grad_();
  auto loc = loc64.to(device, loc_dtype).requires_grad_();
  auto attn = attn64.to(device, loc_dtype).requires_grad_();
  auto opts = torch::TensorOptions().dtype(torch::kLong).device(device);
  auto shapes = torch::tensor(hw, opts).view({L, 2});
  auto starts = torch::tensor(std::vector<int64_t>{0, 192, 240}, opts);
  auto out = ms_deform_attn::ms_deform_attn(value, shapes, starts, loc, attn, "auto",
                                            std::nullopt, hw);
  out.backward(grad64.to(device, dtype));

  // The reference, in float64 on the CPU, from the same rounded inputs.
  auto rv = value.detach().to(torch::kCPU, torch::kDouble).requires_grad_();
  auto rl = loc.detach().to(torch::kCPU, torch::kDouble).requires_grad_();
  auto ra = attn.detach().to(torch::kCPU, torch::kDouble).requires_grad_();
  auto ref = reference(rv, hw, rl, ra);
  ref.backward(grad64.to(dtype).to(torch::kDouble));

  std::printf("%s, value %s (backend %s):\n", device.str().c_str(),
              c10::toString(c10::typeMetaToScalarType(value.dtype())),
              ms_deform_attn::select_backend(value, shapes, starts, loc, attn, hw).c_str());
  bool ok = check("forward", rel_err(out.cpu(), ref.detach()), tol);
  ok &= check("grad value", rel_err(value.grad().cpu(), rv.grad()), tol);
  ok &= check("grad sampling_locations", rel_err(loc.grad().cpu(), rl.grad()), 2 * tol);
  ok &= check("grad attention_weights", rel_err(attn.grad().cpu(), ra.grad()), tol);

  // The fused operator, from the layer's raw outputs: reference points,
  // sampling offsets (pixels of each level) and attention logits; the
  // reference forms locations and softmax from the same rounded inputs.
  auto ref_pts64 = torch::rand({N, Lq, L, 2}, f64);
  auto off64 = torch::randn({N, Lq, M, L, P, 2}, f64) * 2;
  auto logits64 = torch::randn({N, Lq, M, L * P}, f64);
  auto ref_pts = ref_pts64.to(device, loc_dtype);
  auto off = off64.to(device, loc_dtype).requires_grad_();
  auto logits = logits64.to(device, loc_dtype).requires_grad_();
  auto fvalue = value.detach().requires_grad_();
  auto fout = ms_deform_attn::ms_deform_attn_fused(fvalue, shapes, starts, ref_pts, off, logits,
                                                   "auto", std::nullopt, hw);
  fout.backward(grad64.to(device, dtype));
  auto fv = value.detach().to(torch::kCPU, torch::kDouble).requires_grad_();
  auto ro = off.detach().to(torch::kCPU, torch::kDouble).requires_grad_();
  auto rz = logits.detach().to(torch::kCPU, torch::kDouble).requires_grad_();
  auto wh = torch::tensor(std::vector<double>{16, 12, 8, 6, 4, 3}, f64).view({1, 1, 1, L, 1, 2});
  auto floc = ref_pts.to(torch::kCPU, torch::kDouble).view({N, Lq, 1, L, 1, 2}) + ro / wh;
  auto fattn = torch::softmax(rz, -1).view({N, Lq, M, L, P});
  auto fref = reference(fv, hw, floc, fattn);
  fref.backward(grad64.to(dtype).to(torch::kDouble));
  ok &= check("fused forward", rel_err(fout.cpu(), fref.detach()), tol);
  ok &= check("fused grad value", rel_err(fvalue.grad().cpu(), fv.grad()), tol);
  ok &= check("fused grad sampling_offsets", rel_err(off.grad().cpu(), ro.grad()), 2 * tol);
  ok &= check("fused grad attention_logits", rel_err(logits.grad().cpu(), rz.grad()), 2 * tol);
  return ok;
}

}  // namespace

int main() {
  std::printf("ms_deform_attn %s, CPU backends:", ms_deform_attn_library_version());
  for (const auto& b : ms_deform_attn::available_backends(torch::kCPU)) std::printf(" %s", b.c_str());
  std::printf("\n");
  bool ok = run(torch::kCPU, torch::kFloat, 1e-5) && run(torch::kCPU, torch::kDouble, 1e-12);
  if (torch::cuda::is_available()) {
    ok &= run(torch::kCUDA, torch::kFloat, 1e-5);
    ok &= run(torch::kCUDA, torch::kBFloat16, 1e-2);
  } else {
    std::printf("no CUDA device: CUDA checks skipped\n");
  }
  // Bad input is a c10::Error naming the argument.
  try {
    auto v = torch::randn({1, 5, 1, 4});
    ms_deform_attn::ms_deform_attn(v, torch::tensor({2, 3}).view({1, 2}), torch::tensor({0}),
                                   torch::rand({1, 2, 1, 1, 1, 2}), torch::rand({1, 2, 1, 1, 1}));
    std::printf("bad input: no error raised: FAILED\n");
    ok = false;
  } catch (const c10::Error& e) {
    std::printf("bad input raises: %s\n", e.what_without_backtrace());
  }
  std::printf(ok ? "all checks passed\n" : "SOME CHECKS FAILED\n");
  return ok ? 0 : 1;
}
