"""DAPO: rewards → advantages (``advantages``), the policy loss (``loss``), the trainer (``trainer``)."""
