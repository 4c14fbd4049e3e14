"""Rebuild numbers, figures and tables from run logs (local run directories or wandb)."""
