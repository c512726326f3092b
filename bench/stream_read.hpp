// The decode benchmark's streaming-read bound (stream_read.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace bench {

// Reads bytes_each bytes of a and of b (16-byte aligned, a multiple of 16) once, on `stream`,
// and writes nothing (sink: a device word written only for an impossible fold of the data).
void stream_read(const void* a, const void* b, std::size_t bytes_each, std::uint32_t* sink,
                 int sms, cudaStream_t stream);

}  // namespace bench
