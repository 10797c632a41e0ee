"""Test helpers that run bootstrap/ scripts in a real Linux guest (QEMU, see ``qemu.py``)."""
