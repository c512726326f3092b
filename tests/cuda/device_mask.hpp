// A host block mask's tensors copied to the device, and the Options that point at them
// (tests/support/block_mask.hpp: HostBlockMask). The copies live as long as the DeviceMask.
#pragma once

#include <memory>
#include <vector>

#include "cuda/device_copy.hpp"
#include "flashattn/attention.hpp"
#include "support/block_mask.hpp"

namespace flashattn::test {

struct DeviceMask {
  std::vector<std::unique_ptr<DeviceCopy>> held;
  Tensor put(const HostTensor& t) {
    if (t.shape().empty()) return {};
    held.push_back(std::make_unique<DeviceCopy>(t));
    return held.back()->view();
  }
  void apply(const HostBlockMask& m, Options& o) {
    m.apply(o);
    BlockSparseTensors& bs = o.block_sparse;
    bs.mask_block_cnt = put(m.mask_cnt_t);
    bs.mask_block_idx = put(m.mask_idx_t);
    if (!m.full_cnt.empty()) {
      bs.full_block_cnt = put(m.full_cnt_t);
      bs.full_block_idx = put(m.full_idx_t);
    }
    if (!m.docs_q.empty()) {
      bs.q_doc_ids = put(m.docs_q_t);
      bs.k_doc_ids = put(m.docs_k_t);
    }
    if (!m.prefix.empty()) bs.prefix_keys = put(m.prefix_t);
  }
};

}  // namespace flashattn::test
