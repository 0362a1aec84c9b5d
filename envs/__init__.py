"""Environments for multi-turn episodes: the interface (envs.base), tool calls (envs.tools), built-ins."""
