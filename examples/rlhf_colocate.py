"""Colocated RL: the trainer and the rollout engine share the device. The engine sleeps while
the trainer trains (on a GPU its memory goes back to the driver), then takes the new weights
straight from the trainer's tensors (through CUDA IPC on a GPU, as bytes on a CPU) and wakes
up. Runs on a CPU machine.

python examples/rlhf_colocate.py [MODEL_DIR]        # default: the demo model
"""

import sys

import torch

from shoal import LLM, SamplingParams

PROMPTS = ["The capital of France is", "The three primary colors are"]
NUM_STEPS = 3


def train_step(model: torch.nn.Module, step: int) -> None:
    """Stands in for an optimizer step: a little noise on every weight."""
    generator = torch.Generator(device=model.device).manual_seed(step)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.005 * torch.randn(param.shape, generator=generator, device=model.device))


def main() -> None:
    from transformers import AutoModelForCausalLM

    from shoal.demo_model import ensure_demo_model

    model_dir = sys.argv[1] if len(sys.argv) > 1 else ensure_demo_model()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    trainer_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    # On a GPU, enable_sleep_mode keeps the weights' addresses across sleeps (no graph recapture).
    llm = LLM(model_dir, dtype=str(dtype).removeprefix("torch."), max_model_len=256, enable_sleep_mode=device == "cuda")
    params = SamplingParams(temperature=0.0, max_tokens=12)

    for step in range(1, NUM_STEPS + 1):
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)  # the rollout
        print(f"weights {llm.weight_version}: {outputs[0].outputs[0].text!r}")
        llm.sleep(level=2)  # the weights will be replaced: level 2 drops them without a copy
        train_step(trainer_model, step)
        llm.wake_up(tags=["weights"])  # memory for the weights first, the KV cache after
        llm.update_weights_from_tensors(trainer_model, weight_version=f"step-{step}")
        llm.wake_up(tags=["kv_cache"])

    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    print(f"weights {llm.weight_version}: {outputs[0].outputs[0].text!r}")
    llm.shutdown()


if __name__ == "__main__":
    main()
