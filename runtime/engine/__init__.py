"""The step loop and what it decides with: scheduler, block manager, sequences, the asyncio front. No tensors."""
