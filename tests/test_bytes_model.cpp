// The bytes model (bench/bytes_model.h) against ALGORITHM.md §6, §7 and the §9 table.

#include <gtest/gtest.h>

#include "bench.h"
#include "bytes_model.h"

namespace replayssm {
namespace {

constexpr double kGB = 1e9;

BytesModelCase case_at(const StateDims& dims, DecodeMode mode, CheckpointPrecision checkpoint) {
  BytesModelCase c;
  c.dims = dims;
  c.batch = 256;
  c.mode = mode;
  c.checkpoint = checkpoint;
  c.buffer_len = 16;
  c.input_dtype = DType::kBF16;
  return c;
}

// ALGORITHM.md §9: batch 256, one layer, fp32 state, L = 16, GB per decode step.
struct TableRow {
  const char* layer;
  StateDims dims;
  double eager, replay, dual_bf16, dual_fp8;
};

TEST(BytesModel, ReproducesAlgorithmSection9Table) {
  const TableRow rows[] = {
      {"Mamba-2 128x64x128", state_dims(Mamba2Shape{128, 64, 128, 8}), 2.15, 1.19, 0.74, 0.46},
      {"GDN 32x128x128", state_dims(GdnShape{16, 32, 128, 128}), 1.07, 0.60, 0.38, 0.24},
  };
  for (const TableRow& row : rows) {
    const auto gb = [&row](DecodeMode mode, CheckpointPrecision c) {
      return bytes_model_step(case_at(row.dims, mode, c)).total() / kGB;
    };
    // Eager is exact: one read and one write of 256 fp32 states.
    EXPECT_NEAR(gb(DecodeMode::kEager, CheckpointPrecision::kFp32), row.eager, 0.005) << row.layer;
    // The table's "≈" entries are rounded estimates. The model counts the ring (bf16
    // activations, (L−1)/2 + 2 records per step) and fp8's per-row scales; that puts the
    // Mamba-2 dual entries 1.6% (bf16) and 3.4% (fp8) above the table and every other entry
    // within 1.8%: 4% holds all of them, while a missing term (the fold's read, the ring,
    // the low copy's write) moves an entry by 6% or more.
    EXPECT_NEAR(gb(DecodeMode::kReplay, CheckpointPrecision::kFp32), row.replay, 0.04 * row.replay)
        << row.layer;
    EXPECT_NEAR(gb(DecodeMode::kReplay, CheckpointPrecision::kFp32Bf16), row.dual_bf16,
                0.04 * row.dual_bf16)
        << row.layer;
    EXPECT_NEAR(gb(DecodeMode::kReplay, CheckpointPrecision::kFp32Fp8), row.dual_fp8,
                0.04 * row.dual_fp8)
        << row.layer;
  }
}

TEST(BytesModel, DualPrecisionStateBytesPerElement) {
  // §6: size(lo) + (2·4 + size(lo)) / L per element: 2.625 B (bf16) at L = 16; without the
  // ring and fp8 scales, so take the state terms only.
  const StateDims dims{1, 1, 64, 1};
  BytesModelCase c = case_at(dims, DecodeMode::kReplay, CheckpointPrecision::kFp32Bf16);
  c.batch = 1;
  StepBytes b = bytes_model_step(c);
  EXPECT_DOUBLE_EQ((b.state_read + b.state_write) / 64, 2.0 + 10.0 / 16);
  c.checkpoint = CheckpointPrecision::kFp32;
  b = bytes_model_step(c);
  EXPECT_DOUBLE_EQ((b.state_read + b.state_write) / 64, 4.0 + 4.0 / 16);  // read + write / L
}

TEST(BytesModel, RingRecordsPerStep) {
  // Plain decoding: write 1, read the history ((L − 1)/2 on average) and the fold's 1.
  const StateDims dims = state_dims(Mamba2Shape{128, 64, 128, 8});
  BytesModelCase c = case_at(dims, DecodeMode::kReplay, CheckpointPrecision::kFp32);
  c.batch = 1;
  const double record = bytes_model_ring_record(dims, DType::kBF16);
  EXPECT_DOUBLE_EQ(record, 2.0 * (128 * 64 + 8 * 128) + 8.0 * 128);
  const StepBytes b = bytes_model_step(c);
  EXPECT_DOUBLE_EQ(b.ring_write, record);
  EXPECT_DOUBLE_EQ(b.ring_read, record * (7.5 + 1.0));
}

TEST(BytesModel, SpecVerifyIsAQuarterOfEagerSpecAtT4) {
  // §7 / BENCHMARKS.md target: a T = 4 verify window moves ≤ ¼ of eager spec's state bytes
  // (eager: read + 4 writes; replay: one read + a fold every L / 4 steps).
  const StateDims dims = state_dims(Mamba2Shape{128, 64, 128, 8});
  BytesModelCase eager = case_at(dims, DecodeMode::kEager, CheckpointPrecision::kFp32);
  eager.spec_tokens = 4;
  BytesModelCase replay = case_at(dims, DecodeMode::kReplay, CheckpointPrecision::kFp32);
  replay.spec_tokens = 4;
  const StepBytes e = bytes_model_step(eager);
  const StepBytes r = bytes_model_step(replay);
  EXPECT_DOUBLE_EQ(e.state_read + e.state_write, 5.0 * 256 * dims.state_elems() * 4);
  EXPECT_LE(r.state_read + r.state_write, 0.25 * (e.state_read + e.state_write));
  // Fewer accepted tokens per step: folds come less often.
  replay.accepted = 1;
  const StepBytes r1 = bytes_model_step(replay);
  EXPECT_LT(r1.state_write, r.state_write);
}

TEST(BytesModel, BenchShapesAreTheProtocolShapes) {
  ASSERT_EQ(bench_shapes().size(), 4u);
  const BenchShape* s = bench_shape_find("super120b");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->dims().state_elems(), 128 * 64 * 128);
  EXPECT_EQ(bench_shape_find("qwen35-122b")->dims().heads, 64);
  EXPECT_EQ(bench_shape_find("nano4b")->dims().rows, 80);
  EXPECT_EQ(bench_shape_find("nope"), nullptr);
}

}  // namespace
}  // namespace replayssm
