"""The offline API: ``LLM(...).generate(prompts, SamplingParams(...))`` and ``.chat``.

Usage::

    from tandem import LLM, SamplingParams

    llm = LLM()  # the default model, SmolLM2-135M-Instruct
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, cast

from tandem.engine.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tandem.engine.generation_config import load_sampling_defaults
from tandem.engine.llm_engine import LLMEngine, OutputKind, PromptType
from tandem.engine.model_files import resolve_model_path
from tandem.engine.outputs import RequestOutput
from tandem.engine.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """An engine for offline batches, vLLM's ``LLM`` in small.

    Args:
        model: ``None`` (the default SmolLM2-135M-Instruct GGUF), a local Hugging
            Face folder or a local ``.gguf`` file.
        dtype: "auto", "float32", "bfloat16" or "float16".
        device: "cpu" or "cuda[:N]".
        max_model_len: context length in tokens (``None``: the model's).
        block_size: tokens per KV block.
        kv_cache_memory: KV cache budget in bytes (``None``: measured).
        kv_cache_dtype: the KV cache's element type (vLLM's name): "auto" (the model's
            dtype), "fp8" / "fp8_e4m3" or "fp8_e5m2" (``CacheConfig.cache_dtype``).
        gpu_memory_utilization: the fraction of the GPU's total memory this engine may
            take, weights and activations included (vLLM's name; default 0.9); engines
            sharing a GPU split it. See ``CacheConfig``.
        num_blocks: force this many KV blocks (tests of preemption).
        max_num_batched_tokens: token budget of one engine step.
        max_num_seqs: most requests running at once.
        enable_prefix_caching: reuse cached KV blocks across requests.
        enable_chunked_prefill: split long prompts across steps.
        long_prefill_token_threshold: most prompt tokens one request may take per
            step (0 = no cap); see ``SchedulerConfig``.
        seed: seed of the generator used by unseeded random sampling.
        scheduling_policy: "fcfs" or "priority" (vLLM's name; ``SchedulerConfig.policy``):
            under "priority" a request's ``priority`` (lower first) orders the waiting
            queue and a full batch preempts its lowest-priority request for a more
            urgent one; under "fcfs" a non-zero ``priority`` is a ``ValueError``.
        loaded: an already loaded model (``model_loader.load_model``) to reuse (not
            with ``deterministic``: a loaded model's linears may already be packed
            for the default, batch-dependent kernels).
        deterministic: batch-invariant kernels, so a greedy request's tokens do not
            depend on the batch, the prefix cache or chunking; see
            ``ModelConfig.deterministic`` (CPU only, costs throughput).
        tensor_parallel_size: worker processes that split each layer (vLLM's name).
        pipeline_parallel_size: worker processes that split the layer stack.
        enable_expert_parallel: MoE models hold whole experts per tensor-parallel rank
            (``ParallelConfig.enable_expert_parallel``).
        distributed_executor_backend: "uni" or "mp"; ``None`` picks "mp" for more than
            one worker (see ``ParallelConfig``). Call ``shutdown()`` (or use the ``LLM``
            as a context manager) to stop worker processes before the interpreter exits.
        enforce_eager: never replay CUDA graphs (``ModelConfig.enforce_eager``).
        model_impl: "auto", "tandem" or "transformers" (vLLM's name; see
            ``ModelConfig.model_impl``).
        quantization: quantized weights (vLLM's name; ``ModelConfig.quantization``):
            ``None`` the checkpoint's own, or gptq, awq, compressed-tensors, fp8, and
            int8 / int4 (quantized on load).
        compilation_config: the CUDA graph capture sizes, a ``CompilationConfig`` or
            its fields as a mapping (vLLM's ``cudagraph_capture_sizes``,
            ``max_cudagraph_capture_size``); ``None``: the defaults. CUDA only.
        generation_config: where the default sampling values come from (vLLM's flag):
            ``"auto"`` the model folder's ``generation_config.json``, ``"vllm"`` none,
            or a folder holding that file; see :meth:`get_default_sampling_params`.

    Raises:
        ValueError: naming the field, for a bad setting or an unknown model path.
    """

    def __init__(
        self,
        model: str | None = ModelConfig.model,
        dtype: str = ModelConfig.dtype,
        device: str = ModelConfig.device,
        max_model_len: int | None = ModelConfig.max_model_len,
        block_size: int = CacheConfig.block_size,
        kv_cache_memory: int | None = CacheConfig.kv_cache_memory_bytes,
        gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization,
        num_blocks: int | None = CacheConfig.num_blocks_override,
        max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
        max_num_seqs: int = SchedulerConfig.max_num_seqs,
        enable_prefix_caching: bool = CacheConfig.enable_prefix_caching,
        enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill,
        long_prefill_token_threshold: int = SchedulerConfig.long_prefill_token_threshold,
        seed: int = ModelConfig.seed,
        scheduling_policy: str = SchedulerConfig.policy,
        loaded: Any | None = None,
        speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
        deterministic: bool = ModelConfig.deterministic,
        tensor_parallel_size: int = ParallelConfig.tensor_parallel_size,
        pipeline_parallel_size: int = ParallelConfig.pipeline_parallel_size,
        enable_expert_parallel: bool = ParallelConfig.enable_expert_parallel,
        distributed_executor_backend: str | None = ParallelConfig.distributed_executor_backend,
        enforce_eager: bool = ModelConfig.enforce_eager,
        compilation_config: dict[str, Any] | CompilationConfig | None = None,
        generation_config: str = "auto",
        model_impl: str = ModelConfig.model_impl,
        quantization: str | None = ModelConfig.quantization,
        kv_cache_dtype: str = CacheConfig.cache_dtype,
    ) -> None:
        if scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {scheduling_policy!r}")
        folder, gguf = resolve_model_path(model)
        # read first: a bad file fails before the model loads
        self.sampling_defaults = load_sampling_defaults(
            generation_config, None if gguf is not None else folder)
        config = EngineConfig(
            model=ModelConfig(
                model=model,
                dtype=dtype,  # type: ignore[arg-type]
                device=device,
                max_model_len=max_model_len,
                seed=seed,
                deterministic=deterministic,
                enforce_eager=enforce_eager,
                model_impl=model_impl,  # type: ignore[arg-type]
                quantization=quantization,
            ),
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory_bytes=kv_cache_memory,
                gpu_memory_utilization=gpu_memory_utilization,
                num_blocks_override=num_blocks,
                enable_prefix_caching=enable_prefix_caching,
                cache_dtype=kv_cache_dtype,  # type: ignore[arg-type]
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                policy=scheduling_policy,  # type: ignore[arg-type]
                enable_chunked_prefill=enable_chunked_prefill,
                long_prefill_token_threshold=long_prefill_token_threshold,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size,
                enable_expert_parallel=enable_expert_parallel,
                distributed_executor_backend=distributed_executor_backend,  # type: ignore[arg-type]
            ),
            speculative=(
                None if speculative_config is None
                else SpeculativeConfig.from_dict(speculative_config)
            ),
            compilation=(
                CompilationConfig() if compilation_config is None
                else CompilationConfig.from_dict(compilation_config)
            ),
        )
        self.llm_engine = LLMEngine(config, loaded=loaded)
        self._shut_down = False

    def shutdown(self) -> None:
        """Stop the engine: abort what is left and release the workers (worker
        processes exit; their KV caches and weights are freed). Idempotent."""
        if not self._shut_down:
            self._shut_down = True
            self.llm_engine.engine_core.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters of ``generate``/``chat`` calls that pass none: the
        generation config's values (``generation_config``) over ``SamplingParams()``'s,
        as vLLM's ``LLM.get_default_sampling_params``."""
        d = self.sampling_defaults
        params = SamplingParams(**d.resolve())
        return params if d.max_tokens is None else replace(params, max_tokens=d.max_tokens)

    def get_tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer."""
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for a batch of prompts.

        Args:
            prompts: one prompt or a list; each a string or a list of token ids.
            sampling_params: one for all prompts, or one per prompt; default
                :meth:`get_default_sampling_params`.
            use_tqdm: show a progress bar (completed requests, output tokens/s).

        Returns:
            One finished ``RequestOutput`` per prompt, in input order.

        Raises:
            ValueError: naming the field, for any bad prompt or parameter; raised
                before any request is queued.
        """
        batch = self._as_batch(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(batch)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(batch):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(batch)} prompts"
                )
        return self._run(batch, params_list, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations through the tokenizer's chat template.

        Args:
            messages: one conversation (a list of ``{"role", "content"}`` dicts) or
                a list of them.
            add_generation_prompt: end the prompt with the assistant turn's header.
            chat_template: a Jinja template overriding the tokenizer's.

        Returns:
            One ``RequestOutput`` per conversation, in input order.

        Raises:
            ValueError: malformed messages or a tokenizer without a chat template.
        """
        if not messages:
            raise ValueError("messages must not be empty")
        convs: list[Conversation]
        convs = [messages] if isinstance(messages[0], dict) else list(messages)  # type: ignore[list-item,arg-type]
        tok = self.get_tokenizer()
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template; pass chat_template")
        prompts: list[PromptType] = []
        for conv in convs:
            if not conv or not all(isinstance(m, dict) and "role" in m for m in conv):
                raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
            text = tok.apply_chat_template(
                conv,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
            )
            # NOTE: the template already holds the special tokens it wants.
            prompts.append(list(tok.encode(text, add_special_tokens=False)))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # -- internals -----------------------------------------------------------------------------

    @staticmethod
    def _as_batch(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, str):
            return [prompts]
        items = list(prompts)
        # The union does not narrow by its first item: a list whose first item is an
        # int is one prompt of token ids, any other a list of prompts.
        if items and isinstance(items[0], int):
            return [cast("list[int]", items)]
        return cast("list[PromptType]", items)

    def _run(
        self, batch: list[PromptType], params_list: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        # Build and validate every request before queueing any, so that one bad
        # prompt leaves the engine untouched.
        built = []
        for prompt, params in zip(batch, params_list, strict=True):
            rid = engine.new_request_id()
            built.append(engine.make_requests(rid, prompt, params, kind=OutputKind.FINAL_ONLY))
        order = {parent.request_id: i for i, (parent, _) in enumerate(built)}
        results: list[RequestOutput | None] = [None] * len(built)
        for parent, requests in built:
            engine.add_parent(parent, requests)

        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(built), desc="Processed prompts", dynamic_ncols=True)
        try:
            num_done = 0
            num_out_tokens = 0
            while num_done < len(built):
                for out in engine.step():
                    if not out.finished:
                        continue
                    results[order[out.request_id]] = out
                    num_done += 1
                    if pbar is not None:
                        num_out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        rate = num_out_tokens / max(pbar.format_dict["elapsed"], 1e-6)
                        pbar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
                        pbar.update(1)
        except BaseException:
            # Interrupted (KeyboardInterrupt, engine error): free what is left.
            engine.abort_request([p.request_id for p, _ in built])
            engine.step()
            raise
        finally:
            if pbar is not None:
                pbar.close()
        return [r for r in results if r is not None]
