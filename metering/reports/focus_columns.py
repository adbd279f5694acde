"""The FinOps FOCUS 1.2 columns (FinOps-Open-Cost-and-Usage-Spec/FOCUS_Spec, tag v1.2,
specification/columns/*.md): each column's id, feature level, whether it may be null and its
data type, as the specification lists them. The export (metering.reports.focus) writes every
Mandatory column and the Conditional and Recommended ones that apply to LLM usage; the tests
check the export against this list."""

from dataclasses import dataclass

VERSION = "1.2"

MANDATORY, CONDITIONAL, RECOMMENDED = "Mandatory", "Conditional", "Recommended"
STRING, DECIMAL, DATETIME, JSON = "String", "Decimal", "Date/Time", "JSON"


@dataclass(frozen=True, slots=True)
class FocusColumn:
    name: str
    level: str
    nullable: bool
    type: str


SPEC = (
    FocusColumn("AvailabilityZone", RECOMMENDED, True, STRING),
    FocusColumn("BilledCost", MANDATORY, False, DECIMAL),
    FocusColumn("BillingAccountId", MANDATORY, False, STRING),
    FocusColumn("BillingAccountName", MANDATORY, True, STRING),
    FocusColumn("BillingAccountType", CONDITIONAL, False, STRING),
    FocusColumn("BillingCurrency", MANDATORY, False, STRING),
    FocusColumn("BillingPeriodEnd", MANDATORY, False, DATETIME),
    FocusColumn("BillingPeriodStart", MANDATORY, False, DATETIME),
    FocusColumn("CapacityReservationId", CONDITIONAL, True, STRING),
    FocusColumn("CapacityReservationStatus", CONDITIONAL, True, STRING),
    FocusColumn("ChargeCategory", MANDATORY, False, STRING),
    FocusColumn("ChargeClass", MANDATORY, True, STRING),
    FocusColumn("ChargeDescription", MANDATORY, True, STRING),
    FocusColumn("ChargeFrequency", RECOMMENDED, False, STRING),
    FocusColumn("ChargePeriodEnd", MANDATORY, False, DATETIME),
    FocusColumn("ChargePeriodStart", MANDATORY, False, DATETIME),
    FocusColumn("CommitmentDiscountCategory", CONDITIONAL, True, STRING),
    FocusColumn("CommitmentDiscountId", CONDITIONAL, True, STRING),
    FocusColumn("CommitmentDiscountName", CONDITIONAL, True, STRING),
    FocusColumn("CommitmentDiscountQuantity", CONDITIONAL, True, DECIMAL),
    FocusColumn("CommitmentDiscountStatus", CONDITIONAL, True, STRING),
    FocusColumn("CommitmentDiscountType", CONDITIONAL, True, STRING),
    FocusColumn("CommitmentDiscountUnit", CONDITIONAL, True, STRING),
    FocusColumn("ConsumedQuantity", CONDITIONAL, True, DECIMAL),
    FocusColumn("ConsumedUnit", CONDITIONAL, True, STRING),
    FocusColumn("ContractedCost", MANDATORY, False, DECIMAL),
    FocusColumn("ContractedUnitPrice", CONDITIONAL, True, DECIMAL),
    FocusColumn("EffectiveCost", MANDATORY, False, DECIMAL),
    FocusColumn("InvoiceId", RECOMMENDED, True, STRING),
    FocusColumn("InvoiceIssuerName", MANDATORY, False, STRING),
    FocusColumn("ListCost", MANDATORY, False, DECIMAL),
    FocusColumn("ListUnitPrice", CONDITIONAL, True, DECIMAL),
    FocusColumn("PricingCategory", CONDITIONAL, True, STRING),
    FocusColumn("PricingCurrency", CONDITIONAL, True, STRING),
    FocusColumn("PricingCurrencyContractedUnitPrice", CONDITIONAL, True, DECIMAL),
    FocusColumn("PricingCurrencyEffectiveCost", CONDITIONAL, True, DECIMAL),
    FocusColumn("PricingCurrencyListUnitPrice", CONDITIONAL, True, DECIMAL),
    FocusColumn("PricingQuantity", MANDATORY, True, DECIMAL),
    FocusColumn("PricingUnit", MANDATORY, True, STRING),
    FocusColumn("ProviderName", MANDATORY, False, STRING),
    FocusColumn("PublisherName", MANDATORY, False, STRING),
    FocusColumn("RegionId", CONDITIONAL, True, STRING),
    FocusColumn("RegionName", CONDITIONAL, True, STRING),
    FocusColumn("ResourceId", CONDITIONAL, True, STRING),
    FocusColumn("ResourceName", CONDITIONAL, True, STRING),
    FocusColumn("ResourceType", CONDITIONAL, True, STRING),
    FocusColumn("ServiceCategory", MANDATORY, False, STRING),
    FocusColumn("ServiceName", MANDATORY, False, STRING),
    FocusColumn("ServiceSubcategory", RECOMMENDED, False, STRING),
    FocusColumn("SkuId", CONDITIONAL, True, STRING),
    FocusColumn("SkuMeter", CONDITIONAL, True, STRING),
    FocusColumn("SkuPriceDetails", CONDITIONAL, True, JSON),
    FocusColumn("SkuPriceId", CONDITIONAL, True, STRING),
    FocusColumn("SubAccountId", CONDITIONAL, True, STRING),
    FocusColumn("SubAccountName", CONDITIONAL, True, STRING),
    FocusColumn("SubAccountType", CONDITIONAL, True, STRING),
    FocusColumn("Tags", CONDITIONAL, True, JSON),
)
BY_NAME = {column.name: column for column in SPEC}

# Allowed values of the columns the export fills from a fixed set (their specification pages).
CHARGE_CATEGORIES = ("Usage", "Purchase", "Tax", "Credit", "Adjustment")
CHARGE_FREQUENCIES = ("One-Time", "Recurring", "Usage-Based")
PRICING_CATEGORIES = ("Standard", "Dynamic", "Committed", "Other")
SERVICE_CATEGORY = "AI and Machine Learning"
SERVICE_SUBCATEGORY = "Generative AI"  # of "AI and Machine Learning"
