"""floorline's own engine as a tool: `generate` streams a reply, `serve` answers the OpenAI
protocol."""

from __future__ import annotations

import math
import sys
from typing import Annotated

import typer

from floorline.cli.app import interruptible
from floorline.cli.options import (
    DEVICE_OPTION,
    DRAFT_OPTION,
    DRAFT_TOKENS_OPTION,
    GPU_OPTION,
    MAX_CONTEXT,
    SEED_MAX,
    check_device,
    draft_tokens_value,
    resolve_gpu,
)
from floorline.cli.render import err
from floorline.errors import FloorlineError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@interruptible("generation stopped")
def generate_cmd(
    model: Annotated[str, typer.Option(
        help="Checkpoint directory: config.json, *.safetensors and a tokenizer.")],
    prompt: Annotated[str, typer.Option(
        help="The prompt: one user message when the tokenizer has a chat template.")],
    max_new_tokens: Annotated[int, typer.Option(
        min=1, max=MAX_CONTEXT, help="Stop after this many new tokens, if no EOS came.")] = 128,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(
        help="Nucleus sampling: the smallest set of tokens with this much probability, "
             "in (0, 1].")] = 1.0,
    seed: Annotated[int, typer.Option(min=0, max=SEED_MAX)] = 0,
    device: DEVICE_OPTION = None,
    dtype: Annotated[str, typer.Option(help="bfloat16 or float32.")] = "bfloat16",
    no_chat: Annotated[bool, typer.Option(
        "--no-chat", help="Encode the prompt as it is, without the chat template.")] = False,
    draft: DRAFT_OPTION = None,
    draft_tokens: DRAFT_TOKENS_OPTION = "auto",
    weights: Annotated[str | None, typer.Option(
        help="Format of the decoder's linears: int4, fp8 or bf16 (a 16-bit checkpoint is "
             "quantised at load), or gguf: the model directory's GGUF file, its blocks and LM "
             "head as stored. Default: the checkpoint's own (AWQ/GPTQ run as int4).")] = None,
    group_size: Annotated[int | None, typer.Option(
        help="int4's group along K: 32, 64 or 128. Default: an AWQ/GPTQ checkpoint's own, else "
             "the largest that divides every matrix width.")] = None,
    head: Annotated[str, typer.Option(
        help="Format of the LM head: bf16 (16-bit) or fp8 (one scale per row).")] = "bf16",
    kv_dtype: Annotated[str, typer.Option(
        help="Format of the KV cache: bf16 (the 16-bit dtype) or fp8 (e4m3, one scale per token "
             "and kv head).")] = "bf16",
    gpu: GPU_OPTION = None,
) -> None:
    """Generate text with floorline's engine, streamed to stdout; speed against the floor on stderr."""  # noqa: E501
    from floorline.engine.generate import generate  # loads torch, Triton and transformers

    if not math.isfinite(temperature):  # click's range check lets NaN through in some versions
        raise FloorlineError(f"--temperature must be a finite number, got {temperature}")
    device = check_device(device)
    gpu_spec = resolve_gpu(gpu, device)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        result = generate(model, prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=top_p, seed=seed, device=device, dtype=dtype, chat=not no_chat,
                          weights=weights, head=head, kv=kv_dtype, group_size=group_size,
                          draft=draft, draft_tokens=draft_tokens_value(draft_tokens),
                          on_text=write)
    finally:
        write("\n")  # the text's line ends, interrupted or not
    err.print(result.summary(gpu_spec), highlight=False, markup=False, soft_wrap=True)


def serve_cmd(
    model: Annotated[str, typer.Option(
        help="A fetched model's name or a checkpoint directory (config.json, *.safetensors, a "
             "tokenizer).")],
    host: Annotated[str, typer.Option(
        help="Address to listen on; anything but loopback needs --api-key.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8000,
    api_key: Annotated[str | None, typer.Option(
        envvar="FLOORLINE_API_KEY",
        help="Require this key as a bearer token (Authorization: Bearer KEY).")] = None,
    queue: Annotated[int, typer.Option(
        min=0, max=1024, help="Requests that may wait behind the one running; more get 429.")] = 4,
    context: Annotated[int | None, typer.Option(
        min=2, max=MAX_CONTEXT, help="Positions kept, prompt and reply together (default: the "
                                     "model's limit, at most 4096).")] = None,
    served_name: Annotated[str | None, typer.Option(
        help="The model's name in the protocol (default: --model).")] = None,
    device: DEVICE_OPTION = None,
    dtype: Annotated[str, typer.Option(help="bfloat16 or float32.")] = "bfloat16",
    weights: Annotated[str | None, typer.Option(
        help="Format of the decoder's linears: int4, fp8 or bf16 (as generate takes it).")] = None,
    group_size: Annotated[int | None, typer.Option(help="int4's group along K: 32, 64 or 128.")
                          ] = None,
    head: Annotated[str, typer.Option(help="Format of the LM head: bf16 or fp8.")] = "bf16",
    kv_dtype: Annotated[str, typer.Option(help="Format of the KV cache: bf16 or fp8.")] = "bf16",
    no_prefix_cache: Annotated[bool, typer.Option(
        "--no-prefix-cache", help="Prefill every prompt whole, rather than only what follows "
                                  "the previous request's tokens.")] = False,
    draft: DRAFT_OPTION = None,
    draft_tokens: DRAFT_TOKENS_OPTION = "auto",
) -> None:
    """Serve a model on floorline's engine over the OpenAI chat and completions protocol."""
    try:
        import uvicorn

        from floorline.serve.server import create_app
    except ImportError as e:
        raise FloorlineError(f"floorline serve needs its extra: pip install 'floorline[serve]' "
                             f"({e.name} is missing)") from None
    from floorline.serve.api import Model

    if host not in LOOPBACK and not api_key:
        raise FloorlineError(f"--host {host} listens beyond this machine: give --api-key (or "
                             "FLOORLINE_API_KEY) too")
    device = check_device(device)
    loaded = Model(model, device=device, dtype=dtype, weights=weights, head=head, kv=kv_dtype,
                   group_size=group_size, context=context, reuse_prefix=not no_prefix_cache,
                   draft=draft, draft_tokens=draft_tokens_value(draft_tokens))
    err.print(f"serving {loaded.name} on the engine ({device}, weights {loaded.weight_format}, "
              f"KV {loaded.kv_format}, context {loaded.context}) at http://{host}:{port}/v1",
              highlight=False, markup=False, soft_wrap=True)
    uvicorn.run(create_app(loaded, name=served_name, api_key=api_key, queue=queue), host=host,
                port=port, log_level="warning")
