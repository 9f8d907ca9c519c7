"""The source stage: the IMDS client, the Scheduled Events document, its differ, the VM identity and event outcomes."""
