"""A throwaway CA and a 127.0.0.1 server certificate for ``sefwd emulator --arm`` (the ARM side is HTTPS only).

azure-core sends bearer tokens over TLS only, so the emulator's Azure Resource Manager side needs a
certificate the client trusts. Like Azurite and LocalStack, ``--arm`` makes its own: a fresh CA (whose
file ``REQUESTS_CA_BUNDLE`` names) and a server certificate for 127.0.0.1, ::1 and localhost, valid for a
day, in a private directory removed when the emulator stops. ``cryptography`` comes with the ``[arm]``
extra (azure-identity needs it).
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

EXTRA_HINT = "pip install 'scheduled-events-forwarder[arm]'"


@dataclass(frozen=True)
class ArmCertificate:
    """PEM files: the server's certificate and key, and the CA a client must trust."""

    directory: Path
    cert: Path
    key: Path
    ca: Path

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def make_arm_certificate(directory: Path | None = None) -> ArmCertificate:
    """A new CA and a server certificate for loopback, written to ``directory`` (default: a new private temp dir)."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise ImportError(f"--arm makes its certificate with the cryptography package: {EXTRA_HINT}") from None
    folder = Path(tempfile.mkdtemp(prefix="sefwd-emulator-arm-")) if directory is None else directory
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sefwd emulator test CA (throwaway)")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                            crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
               .sign(ca_key, hashes.SHA256()))

    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
             x509.IPAddress(ipaddress.ip_address("::1"))]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))

    found = ArmCertificate(folder, folder / "arm-cert.pem", folder / "arm-key.pem", folder / "arm-ca.pem")
    found.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    found.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    # The key: readable by this user only (the directory from mkdtemp is 0700 already).
    fd = os.open(found.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return found


def export_lines(imds_url: str, arm_url: str, ca: Path | None, resource_id: str) -> list[str]:
    """The shell lines that point ``sefwd approve --via arm`` (azure-identity, azure-core) at the emulator."""
    import shlex

    lines = [
        "# paste into the shell that runs `sefwd approve --via arm` (or `eval` them):",
        f"export AZURE_POD_IDENTITY_AUTHORITY_HOST={shlex.quote(imds_url)}   # managed-identity tokens from the emulator",
        f"export SEFWD_ARM_ENDPOINT={shlex.quote(arm_url)}",
        (f"export REQUESTS_CA_BUNDLE={shlex.quote(str(ca))}   # the emulator's throwaway CA" if ca is not None else
         "# export REQUESTS_CA_BUNDLE=<the CA file that signed the --arm-tls certificate>"),
        f"export SEFWD_IMDS_ENDPOINT={shlex.quote(imds_url)}   # for sefwd once / run against the emulator",
        f"# then: sefwd approve EVENT_ID --via arm --resource-id {resource_id}",
    ]
    return lines
