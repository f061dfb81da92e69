// Device memory that gives its physical pages back while its virtual addresses stay reserved:
// the allocator behind `enable_sleep_mode` (semantics: shoal/kernels/sleep_memory.py).
//
// `shoal_sleep_malloc` / `shoal_sleep_free` are the entry points torch's pluggable allocator
// calls (torch.cuda.memory.CUDAPluggableAllocator, one MemPool per tag). Each allocation is a
// reserved range of virtual addresses with one physical allocation mapped under it (CUDA VMM:
// cuMemAddressReserve, cuMemCreate, cuMemMap, cuMemSetAccess). The registry below remembers
// every allocation with the tag that was current when it was made; `sleep_memory_release(tag)`
// unmaps and frees the physical memory of a tag's allocations (after copying it to pinned host
// memory if asked), `sleep_memory_restore(tag)` maps new physical memory at the same addresses
// and copies the contents back, or zeroes it.
//
// The driver API is reached through cudaGetDriverEntryPointByVersion, so the library links only
// the CUDA runtime torch already uses, not libcuda.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <cstdio>
#include <mutex>
#include <stdexcept>
#include <string>
#include <sys/types.h>
#include <unordered_map>

#include "ops.h"

namespace {

// The driver functions used here, at the ABI versions of CUDA 12.0.
struct DriverApi {
  PFN_cuMemAddressReserve_v10020 address_reserve;
  PFN_cuMemAddressFree_v10020 address_free;
  PFN_cuMemCreate_v10020 create;
  PFN_cuMemRelease_v10020 release;
  PFN_cuMemMap_v10020 map;
  PFN_cuMemUnmap_v10020 unmap;
  PFN_cuMemSetAccess_v10020 set_access;
  PFN_cuMemGetAllocationGranularity_v10020 granularity;
  PFN_cuGetErrorString_v6000 error_string;
};

template <typename Fn>
void load_symbol(const char* name, Fn* fn) {
  cudaDriverEntryPointQueryResult found;
  void* address = nullptr;
  cudaError_t status = cudaGetDriverEntryPointByVersion(name, &address, 12000, cudaEnableDefault, &found);
  if (status != cudaSuccess || found != cudaDriverEntryPointSuccess || address == nullptr) {
    throw std::runtime_error(std::string("sleep_memory: the CUDA driver has no ") + name);
  }
  *fn = reinterpret_cast<Fn>(address);
}

const DriverApi& driver() {
  static const DriverApi api = [] {
    DriverApi d{};
    load_symbol("cuMemAddressReserve", &d.address_reserve);
    load_symbol("cuMemAddressFree", &d.address_free);
    load_symbol("cuMemCreate", &d.create);
    load_symbol("cuMemRelease", &d.release);
    load_symbol("cuMemMap", &d.map);
    load_symbol("cuMemUnmap", &d.unmap);
    load_symbol("cuMemSetAccess", &d.set_access);
    load_symbol("cuMemGetAllocationGranularity", &d.granularity);
    load_symbol("cuGetErrorString", &d.error_string);
    return d;
  }();
  return api;
}

void check(CUresult result, const char* what) {
  if (result == CUDA_SUCCESS) return;
  const char* message = nullptr;
  driver().error_string(result, &message);
  throw std::runtime_error(std::string("sleep_memory: ") + what + ": " + (message ? message : "unknown error"));
}

void check(cudaError_t result, const char* what) {
  if (result == cudaSuccess) return;
  throw std::runtime_error(std::string("sleep_memory: ") + what + ": " + cudaGetErrorString(result));
}

struct Allocation {
  size_t size;  // bytes reserved and, while mapped, backed (a multiple of the granularity)
  int device;
  int64_t tag;
  CUmemGenericAllocationHandle handle;
  bool mapped;
  void* host_copy;         // pinned, kept between releases for reuse (nullptr: none)
  bool host_copy_current;  // the host copy holds the contents of the last release
};

std::mutex registry_mutex;
std::unordered_map<CUdeviceptr, Allocation> registry;
int64_t current_tag = 0;

CUmemAllocationProp device_memory(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

size_t round_up_to_granularity(size_t size, int device) {
  CUmemAllocationProp prop = device_memory(device);
  size_t granularity = 0;
  check(driver().granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity");
  return (size + granularity - 1) / granularity * granularity;
}

// Physical memory under the allocation's addresses, readable and writable by its device.
void map_physical(CUdeviceptr ptr, Allocation& a) {
  CUmemAllocationProp prop = device_memory(a.device);
  check(driver().create(&a.handle, a.size, &prop, 0), "cuMemCreate");
  CUresult mapped = driver().map(ptr, a.size, 0, a.handle, 0);
  if (mapped != CUDA_SUCCESS) {
    driver().release(a.handle);
    check(mapped, "cuMemMap");
  }
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  check(driver().set_access(ptr, a.size, &access, 1), "cuMemSetAccess");
  a.mapped = true;
}

void unmap_physical(CUdeviceptr ptr, Allocation& a) {
  check(driver().unmap(ptr, a.size), "cuMemUnmap");
  check(driver().release(a.handle), "cuMemRelease");
  a.mapped = false;
}

void free_host_copy(Allocation& a) {
  if (a.host_copy != nullptr) cudaFreeHost(a.host_copy);
  a.host_copy = nullptr;
  a.host_copy_current = false;
}

// Makes `device` current for its scope (memsets run on the current device).
struct DeviceGuard {
  int previous = 0;
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous), "cudaGetDevice");
    check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(previous); }
};

// Every device that holds an allocation of `tag` finishes its queued work first: kernels may
// still read memory about to be unmapped.
void synchronize_devices_of(int64_t tag) {
  std::unordered_map<int, bool> seen;
  for (auto& [ptr, a] : registry) {
    if (a.tag != tag || seen[a.device]) continue;
    seen[a.device] = true;
    DeviceGuard guard(a.device);
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
}

}  // namespace

extern "C" {

// torch's pluggable-allocator entry points. Errors cannot propagate through torch's allocator:
// a failed allocation returns nullptr (torch raises its out-of-memory error), a failed free is
// reported on stderr.
void* shoal_sleep_malloc(ssize_t size, int device, cudaStream_t stream) {
  (void)stream;
  try {
    std::lock_guard<std::mutex> lock(registry_mutex);
    Allocation a{round_up_to_granularity(static_cast<size_t>(size), device), device, current_tag, 0, false, nullptr,
                 false};
    CUdeviceptr ptr = 0;
    check(driver().address_reserve(&ptr, a.size, 0, 0, 0), "cuMemAddressReserve");
    try {
      map_physical(ptr, a);
    } catch (...) {
      driver().address_free(ptr, a.size);
      throw;
    }
    registry.emplace(ptr, a);
    return reinterpret_cast<void*>(ptr);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return nullptr;
  }
}

void shoal_sleep_free(void* ptr, ssize_t size, int device, cudaStream_t stream) {
  (void)size;
  (void)device;
  try {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto found = registry.find(reinterpret_cast<CUdeviceptr>(ptr));
    if (found == registry.end()) return;
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");  // no queued kernel still uses it
    Allocation& a = found->second;
    if (a.mapped) unmap_physical(found->first, a);
    free_host_copy(a);
    check(driver().address_free(found->first, a.size), "cuMemAddressFree");
    registry.erase(found);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
  }
}

}  // extern "C"

namespace shoal {

void sleep_memory_set_tag(int64_t tag) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  current_tag = tag;
}

int64_t sleep_memory_release(int64_t tag, bool keep_contents) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  synchronize_devices_of(tag);
  int64_t released = 0;
  for (auto& [ptr, a] : registry) {
    if (a.tag != tag || !a.mapped) continue;
    if (keep_contents) {
      if (a.host_copy == nullptr) check(cudaMallocHost(&a.host_copy, a.size), "cudaMallocHost");
      check(cudaMemcpy(a.host_copy, reinterpret_cast<void*>(ptr), a.size, cudaMemcpyDeviceToHost), "cudaMemcpy");
      a.host_copy_current = true;
    } else {
      free_host_copy(a);
    }
    unmap_physical(ptr, a);
    released += static_cast<int64_t>(a.size);
  }
  return released;
}

int64_t sleep_memory_restore(int64_t tag) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  int64_t restored = 0;
  for (auto& [ptr, a] : registry) {
    if (a.tag != tag || a.mapped) continue;
    DeviceGuard guard(a.device);
    map_physical(ptr, a);
    void* device_ptr = reinterpret_cast<void*>(ptr);
    if (a.host_copy_current) {
      check(cudaMemcpy(device_ptr, a.host_copy, a.size, cudaMemcpyHostToDevice), "cudaMemcpy");
      a.host_copy_current = false;
    } else {
      check(cudaMemset(device_ptr, 0, a.size), "cudaMemset");
    }
    restored += static_cast<int64_t>(a.size);
  }
  synchronize_devices_of(tag);
  return restored;
}

int64_t sleep_memory_mapped_bytes(int64_t tag) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  int64_t mapped = 0;
  for (auto& [ptr, a] : registry) {
    if (a.tag == tag && a.mapped) mapped += static_cast<int64_t>(a.size);
  }
  return mapped;
}

}  // namespace shoal
