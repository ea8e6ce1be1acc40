"""The tool-integrated reasoning protocol shared by RL and eval: prompts, tag parsing, tools, sandbox, search."""
