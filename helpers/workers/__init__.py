"""Code that processes started by a notebook import (DDP ranks, spawned DataLoader workers): a notebook cannot hand them its own functions."""
