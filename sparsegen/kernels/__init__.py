"""Kernel launchers: validate arguments, fetch the compiled kernel, launch it."""
