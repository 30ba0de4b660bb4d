// The environment overrides (overrides.h).
#include "overrides.h"

#include "../binding/check.h"

#include <cstdlib>

namespace msda {
namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

}  // namespace

std::string backend_override() {
  const std::string v = env("MS_DEFORM_ATTN_BACKEND");
  return v == "auto" ? std::string() : v;
}

GradValueRequest grad_value_override() {
  const std::string v = env("MS_DEFORM_ATTN_GRAD_VALUE");
  try {
    return parse_grad_value_request(v);
  } catch (const std::runtime_error&) {
    MSDA_CHECK(false, "ms_deform_attn: MS_DEFORM_ATTN_GRAD_VALUE must be 'auto', 'atomic', "
                "'sorted' or 'local', got '", v, "'");
  }
}

BlockedRows blocked_rows_override() {
  const std::string v = env("MS_DEFORM_ATTN_BLOCKED_ROWS");
  if (v.empty() || v == "auto") return BlockedRows::automatic;
  if (v == "shared") return BlockedRows::shared;
  if (v == "lane") return BlockedRows::lane;
  MSDA_CHECK(false, "ms_deform_attn: MS_DEFORM_ATTN_BLOCKED_ROWS must be 'auto', 'shared' or "
              "'lane', got '", v, "'");
}

bool local_stage_override() {
  const std::string v = env("MS_DEFORM_ATTN_LOCAL_STAGE");
  MSDA_CHECK(v.empty() || v == "0" || v == "1",
             "ms_deform_attn: MS_DEFORM_ATTN_LOCAL_STAGE must be '0' or '1', got '", v, "'");
  return v != "0";
}

bool local_self_override() {
  const std::string v = env("MS_DEFORM_ATTN_LOCAL_SELF");
  MSDA_CHECK(v.empty() || v == "0" || v == "1",
             "ms_deform_attn: MS_DEFORM_ATTN_LOCAL_SELF must be '0' or '1', got '", v, "'");
  return v != "0";
}

int64_t smem_budget_override() {
  const std::string v = env("MS_DEFORM_ATTN_SMEM_BUDGET");
  return v.empty() ? -1 : std::atoll(v.c_str());
}

bool poison_outputs() {
  static const bool poison = env("MS_DEFORM_ATTN_POISON") == "1";
  return poison;
}

bool check_shapes_on_host() { return env("MS_DEFORM_ATTN_CHECK_SHAPES") == "1"; }

}  // namespace msda
